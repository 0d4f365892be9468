"""A pod's NetworkPolicy isolation written while its sandbox's CNI ADD runs in this daemon,
before the sandbox's interface is attached, so that no packet reaches or leaves the pod
unjudged (the hooks of cni.server's calls)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from cni.errors import CniError
from cni.invocation import parse_cni_args
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

    def deleted(self, environ: Mapping[str, str]) -> None:
        pod = sandbox_pod(environ)
        if pod is not None:
            self.enforcer.release(pod[0], pod[1])
