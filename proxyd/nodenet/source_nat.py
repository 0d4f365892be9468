"""Source NAT after routing: pod traffic leaving the cluster's pod CIDRs gets the node's
address, and a peer's own traffic arriving over VXLAN gets the peer's InternalIP.

The second is why a pod sees another node's host, or a connection that node masqueraded, come
from that node's address over VXLAN as over direct routes (what kube-proxy's users expect of
eTP Local NodePorts reached from a node itself). The peer sends it from its VTEP address, so
the routing and reverse-path checks on both sides, and the replies, stay on the overlay; only
the address the pod sees changes, when the packet leaves for it.

Two chains per family in the nat table, rendered (pure) from this node's pod CIDRs, the
cluster's and the peers' VTEP addresses, and loaded with the proxy's own iptables layer.
"""

from __future__ import annotations

import ipaddress

from cni import ip_text
from proxyd.iptables.kernel import IptablesKernel
from proxyd.model import family_of
from proxyd.nodenet.route_plan import PeerVtep

EGRESS_CHAIN = "KNIT-POD-EGRESS"
PEER_CHAIN = "KNIT-OVERLAY-PEERS"
CHAINS = (EGRESS_CHAIN, PEER_CHAIN)
HOOKS = tuple(f"-A POSTROUTING -j {chain}" for chain in CHAINS)


def _in_family(cidrs: tuple[str, ...] | list[str], family: int) -> list[str]:
    return [c for c in cidrs if family_of(c) == family]


def render(family: int, pod_cidrs: tuple[str, ...], cluster_cidrs: tuple[str, ...]) -> list[str]:
    """The chain's rules: leave traffic to cluster CIDRs alone, masquerade the rest. The CIDRs
    are collapsed (nodes' pod CIDRs inside the cluster CIDR leave no rule of their own), so the
    chain stays short and nodes joining and leaving do not rewrite it."""
    rules = []
    networks = [ipaddress.ip_network(cidr) for cidr in _in_family(cluster_cidrs, family)]
    exempt = [str(network) for network in ip_text.collapsed(networks)]
    for source in _in_family(pod_cidrs, family):
        rules += [f"-A {EGRESS_CHAIN} -s {source} -d {dst} -j RETURN" for dst in exempt]
        rules.append(f"-A {EGRESS_CHAIN} -s {source} -j MASQUERADE --random-fully")
    return rules


def render_peers(family: int, peer_vteps: tuple[PeerVtep, ...]) -> list[str]:
    """The peer chain's rules: traffic from a peer's VTEP address gets the peer's InternalIP."""
    return [
        f"-A {PEER_CHAIN} -s {peer.vtep} -j SNAT --to-source {peer.node_address}"
        for peer in peer_vteps
        if family_of(peer.vtep) == family
    ]


def restore_script(rules: list[str], hooks_in_place: list[str]) -> str:
    missing_hooks = [hook for hook in HOOKS if hook not in hooks_in_place]
    lines = ["*nat", *(f":{chain} - [0:0]" for chain in CHAINS), *rules, *missing_hooks]
    return "\n".join([*lines, "COMMIT", ""])


class SourceNat:
    """Keeps both chains of one family as last rendered, rewriting them only on change."""

    def __init__(self, iptables: IptablesKernel) -> None:
        self.iptables = iptables
        self.loaded: list[str] | None = None

    def apply(
        self,
        pod_cidrs: tuple[str, ...],
        cluster_cidrs: tuple[str, ...],
        peer_vteps: tuple[PeerVtep, ...],
    ) -> None:
        family = self.iptables.family
        rules = render(family, pod_cidrs, cluster_cidrs) + render_peers(family, peer_vteps)
        if rules == self.loaded:
            return
        hooks_in_place = self.iptables.chain_rules("nat", "POSTROUTING")
        self.iptables.restore(restore_script(rules, hooks_in_place))
        self.loaded = rules

    def remove(self) -> int:
        self.loaded = None
        return self.iptables.remove_owned(lambda chain: chain in CHAINS)
