"""The source NAT chains' kernel side beyond the lab cluster (test_cluster.py): rewritten in a
node namespace of its own when the cluster's CIDRs and the peers change, each keeps one hook in
nat POSTROUTING."""

from __future__ import annotations

from collections.abc import Callable

from deploy.lab.netns import Netns
from proxyd.iptables.kernel import IptablesKernel
from proxyd.nodenet.route_plan import PeerVtep
from proxyd.nodenet.source_nat import EGRESS_CHAIN, HOOKS, PEER_CHAIN, SourceNat


def test_rewritten_chains_keep_one_hook_each(make_netns: Callable[[str], Netns]) -> None:
    node = make_netns("snat")
    peer = PeerVtep("10.244.3.0", "10.77.2.13")
    with node.entered():
        SourceNat(IptablesKernel(4)).apply(("10.244.1.0/24",), ("10.244.0.0/16",), ())
        SourceNat(IptablesKernel(4)).apply(
            ("10.244.1.0/24",), ("10.244.0.0/16", "10.250.0.0/24"), (peer,)
        )
    saved = node.run("iptables-save", "-t", "nat").stdout.splitlines()
    assert [saved.count(hook) for hook in HOOKS] == [1, 1], "a fresh daemon finds them in place"
    assert [line for line in saved if line.startswith(f"-A {EGRESS_CHAIN}")] == [
        f"-A {EGRESS_CHAIN} -s 10.244.1.0/24 -d 10.244.0.0/16 -j RETURN",
        f"-A {EGRESS_CHAIN} -s 10.244.1.0/24 -d 10.250.0.0/24 -j RETURN",
        f"-A {EGRESS_CHAIN} -s 10.244.1.0/24 -j MASQUERADE --random-fully",
    ]
    assert [line for line in saved if line.startswith(f"-A {PEER_CHAIN}")] == [
        f"-A {PEER_CHAIN} -s 10.244.3.0/32 -j SNAT --to-source 10.77.2.13"
    ]
