"""A lab node rebooted, as its kernel would see it.

Gone, as after a power cut and a boot:

- every process of the node (containerd, kubelet, the shims, every pod's processes, knit-proxyd)
  and its cgroups, killed without a signal they could act on;
- the node's network namespace: its links, addresses, routes, rules, sysctls and firewall,
  and with it the pods' veths. The pods' own network namespaces go too: only their processes
  and their mounts under the node's /run, in the node's mount namespace, held them;
- /run (a tmpfs on a real node): containerd's state, the pods' namespace mounts, knit's
  fast-path socket.

Kept, as on the node's disk: /var/lib (kubelet's, containerd's root with its record of the old
sandboxes, /var/lib/cni with host-local's reservations for pods that no longer exist),
/var/log, and the upper layers of /etc and /opt (knit's CNI config and plugin).

The node then boots as the lab first booted it (`Lab.boot_node`), at the address it had.
"""

from __future__ import annotations

from deploy.lab.kubenode import KubeNode
from deploy.lab.lab import Lab
from deploy.lab.netns import remove_namespace
from deploy.lab.process import eventually, in_ns

LEG_TEARDOWN = 120.0
"""Seconds the kernel has to remove a powered-off node's leg from the router."""


def reboot(lab: Lab, name: str) -> KubeNode:
    """Node NAME powered off and booted again; returns it as booted (its kubelet started, not
    yet Ready)."""
    node = lab.nodes[name]
    node.machine.power_off()
    remove_namespace(node.machine.netns)
    # the kernel tears a deleted namespace's devices down after `ip netns del` returns, the
    # router's end of the node's leg among them, and the new leg takes the same name. It
    # tears namespaces down one batch at a time, each pod's too: after a chaos run's churn
    # left a node some twenty pods, the leg went about 33 s after the deletion (a 30 s wait
    # failed the run once)
    leg = lab.node_leg(name)
    eventually(
        lambda: not in_ns(lab.network.router, "ip", "-o", "link", "show", leg, check=False),
        LEG_TEARDOWN,
        what=f"{leg} gone from the router",
    )
    return lab.boot_node(name)
