"""CHECK with ipMasq verifies the attachment's masquerade rules in the node's namespace."""

from __future__ import annotations

import shlex

import pytest

from cni.netconf import MASQ_BACKENDS
from tests.support.cni_env import NETWORK, Node, bridge_conf


def delete_ipv6_masquerade(node: Node, backend: str) -> None:
    """Remove by hand, as an operator or another agent might, the pod's IPv6 masquerade rule
    and nothing else."""
    if backend == "nftables":
        listing = node.ns.run("nft", "-a", "list", "chain", "inet", "knit_masq", "postrouting")
        (handle,) = [
            line.rsplit("# handle ", 1)[1]
            for line in listing.stdout.splitlines()
            if "ip6 saddr" in line and "masquerade" in line
        ]
        node.ns.run("nft", "delete", "rule", "inet", "knit_masq", "postrouting", "handle", handle)
        return
    (rule,) = [
        line
        for line in node.ns.run("ip6tables-save", "-t", "nat").stdout.splitlines()
        if line.startswith("-A KNIT-MASQ-") and line.endswith("-j MASQUERADE")
    ]
    node.ns.run("ip6tables", "-t", "nat", "-D", *shlex.split(rule[3:]))


@pytest.mark.parametrize("backend", MASQ_BACKENDS)
def test_cni_check_names_a_masquerade_rule_removed_by_hand(node: Node, backend: str) -> None:
    conf = bridge_conf(node.data_dir, dual_stack=True, ipMasq=True, ipMasqBackend=backend)
    pod = node.add_pod(conf, "masq-check")
    checked = node.with_prev(conf, pod)
    assert node.call("CHECK", checked, pod).code == 0

    delete_ipv6_masquerade(node, backend)
    answer = node.call("CHECK", checked, pod)
    assert answer.error_code == 105, answer
    tag = f"knit masq net={NETWORK} id=masq-check if=eth0"
    assert answer.output["msg"] == (
        f'CHECK failed: {backend} masquerade rule "{tag}" for '
        "10.244.1.2/24, fd10:244:1::2/64 is missing"
    )
    assert node.call("DEL", checked, pod).code == 0
    assert node.leftovers() == {}
