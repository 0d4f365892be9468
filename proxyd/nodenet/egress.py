"""Egress masquerade: pod traffic leaving the cluster's pod CIDRs gets the node's address.

One chain per family in the nat table, rendered (pure) from this node's pod CIDRs and the
cluster's, and loaded with the proxy's own iptables layer.
"""

from __future__ import annotations

import ipaddress

from proxyd.iptables.kernel import IptablesKernel
from proxyd.model import family_of

EGRESS_CHAIN = "KNIT-POD-EGRESS"
HOOK = f"-A POSTROUTING -j {EGRESS_CHAIN}"


def _in_family(cidrs: tuple[str, ...] | list[str], family: int) -> list[str]:
    return [c for c in cidrs if family_of(c) == family]


def render(family: int, pod_cidrs: tuple[str, ...], cluster_cidrs: tuple[str, ...]) -> list[str]:
    """The chain's rules: leave traffic to cluster CIDRs alone, masquerade the rest. The CIDRs
    are collapsed (nodes' pod CIDRs inside the cluster CIDR leave no rule of their own), so the
    chain stays short and nodes joining and leaving do not rewrite it."""
    rules = []
    networks = [ipaddress.ip_network(cidr) for cidr in _in_family(cluster_cidrs, family)]
    # All of one family; collapse_addresses takes IPv4 or IPv6 networks, not a mix of both.
    v4 = [network for network in networks if isinstance(network, ipaddress.IPv4Network)]
    v6 = [network for network in networks if isinstance(network, ipaddress.IPv6Network)]
    collapsed = [*ipaddress.collapse_addresses(v4), *ipaddress.collapse_addresses(v6)]
    exempt = [str(network) for network in collapsed]
    for source in _in_family(pod_cidrs, family):
        rules += [f"-A {EGRESS_CHAIN} -s {source} -d {dst} -j RETURN" for dst in exempt]
        rules.append(f"-A {EGRESS_CHAIN} -s {source} -j MASQUERADE --random-fully")
    return rules


def restore_script(rules: list[str], hooked: bool) -> str:
    lines = ["*nat", f":{EGRESS_CHAIN} - [0:0]", *rules]
    if not hooked:
        lines.append(HOOK)
    return "\n".join([*lines, "COMMIT", ""])


class Egress:
    """Keeps the egress chain of one family as last rendered, rewriting it only on change."""

    def __init__(self, iptables: IptablesKernel) -> None:
        self.iptables = iptables
        self.loaded: list[str] | None = None

    def apply(self, pod_cidrs: tuple[str, ...], cluster_cidrs: tuple[str, ...]) -> None:
        rules = render(self.iptables.family, pod_cidrs, cluster_cidrs)
        if rules == self.loaded:
            return
        hooked = HOOK in self.iptables.chain_rules("nat", "POSTROUTING")
        self.iptables.restore(restore_script(rules, hooked))
        self.loaded = rules

    def remove(self) -> int:
        self.loaded = None
        return self.iptables.remove_owned(lambda chain: chain == EGRESS_CHAIN)
