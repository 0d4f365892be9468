"""The egress chain's kernel side beyond the lab cluster (test_cluster.py): rewritten in a node
namespace of its own when the cluster's CIDRs change, it keeps one hook in nat POSTROUTING."""

from __future__ import annotations

from collections.abc import Callable

from deploy.lab.netns import Netns
from proxyd.iptables.kernel import IptablesKernel
from proxyd.nodenet.egress import EGRESS_CHAIN, HOOK, Egress


def test_a_rewritten_egress_chain_keeps_one_hook(make_netns: Callable[[str], Netns]) -> None:
    node = make_netns("egress")
    with node.entered():
        Egress(IptablesKernel(4)).apply(("10.244.1.0/24",), ("10.244.0.0/16",))
        Egress(IptablesKernel(4)).apply(("10.244.1.0/24",), ("10.244.0.0/16", "10.250.0.0/24"))
    saved = node.run("iptables-save", "-t", "nat").stdout.splitlines()
    assert saved.count(HOOK) == 1, "a fresh daemon finds the hook in place"
    assert [line for line in saved if line.startswith(f"-A {EGRESS_CHAIN}")] == [
        f"-A {EGRESS_CHAIN} -s 10.244.1.0/24 -d 10.244.0.0/16 -j RETURN",
        f"-A {EGRESS_CHAIN} -s 10.244.1.0/24 -d 10.250.0.0/24 -j RETURN",
        f"-A {EGRESS_CHAIN} -s 10.244.1.0/24 -j MASQUERADE --random-fully",
    ]
