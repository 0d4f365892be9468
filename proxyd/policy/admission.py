"""A pod's NetworkPolicy isolation written while its sandbox's CNI ADD runs in this daemon,
before the sandbox's interface is attached, so that no packet reaches or leaves the pod
unjudged (the hooks of cni.server's calls).

Once the isolation is in the kernel, the conntrack entries from and to the pod's addresses are
deleted: they were made before the pod existed (a client trying the address early) or by the
address's last pod, and their packets were judged without the pod's policies. An entry left
would let the pod's packet that matches its reply direction pass as an established
connection's, unjudged by the pod's egress policies, and the client's packets after it past
its ingress ones. (The plugin drops, for the same reason, the packets the node queued for the
address while resolving it: cni.bridge.forget_neighbours.)"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from cni.errors import CniError
from cni.invocation import parse_cni_args
from proxyd import conntrack
from proxyd.policy.enforcer import PolicyEnforcer

log = logging.getLogger(__name__)

PodRef = tuple[str, str, str]
"""namespace, name, uid (empty when the runtime does not say)."""


def sandbox_pod(environ: Mapping[str, str]) -> PodRef | None:
    """The pod a call was for, as the runtime named it in CNI_ARGS; None when it names none
    (a runtime other than a kubelet's)."""
    try:
        args = parse_cni_args(environ.get("CNI_ARGS", ""))
    except CniError:
        return None
    namespace, name = args.get("K8S_POD_NAMESPACE", ""), args.get("K8S_POD_NAME", "")
    if not namespace or not name:
        return None
    return namespace, name, args.get("K8S_POD_UID", "")


class PolicyAdmission:
    def __init__(self, enforcer: PolicyEnforcer) -> None:
        self.enforcer = enforcer

    def attaching(self, environ: Mapping[str, str], addresses: tuple[str, ...]) -> None:
        pod = sandbox_pod(environ)
        if pod is None:
            return
        namespace, name, uid = pod
        if not self.enforcer.admit(namespace, name, uid, addresses):
            log.warning(
                "pod %s/%s: its policies were not written before its interface was attached "
                "(the API does not know the pod, or the sync took too long)",
                namespace,
                name,
            )
        try:
            conntrack.forget_addresses(addresses)
        except OSError as err:  # RawNetlinkError too
            log.warning(
                "pod %s/%s: cannot delete the conntrack entries of %s: %s",
                namespace,
                name,
                ", ".join(addresses),
                err,
            )

    def deleted(self, environ: Mapping[str, str]) -> None:
        pod = sandbox_pod(environ)
        if pod is not None:
            self.enforcer.release(pod[0], pod[1])
