"""The plugin's nftables rules through libnftables in its own process: an ADD whose rules
libnftables cannot write (the library missing, a rule the kernel refuses) answers code 103 and
leaves nothing half-made; the tagged rules listed are the ones nft lists, with nft's handles;
a netlink socket libnftables could not open is an error, not the end of the process."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest

from cni.kernel.firewall import Tag
from cni.kernel.nftables import LIBRARY_ENV, nft_apply, nft_tagged_rules
from deploy.lab.netns import Netns
from deploy.lab.paths import ROOT
from tests.support.cni_env import Node, bridge_conf

MASQ = {"ipMasq": True, "ipMasqBackend": "nftables"}
SPOOFCHK = {"macspoofchk": True}
CHAIN = "inet knit_masq postrouting"


@pytest.mark.parametrize("options", [MASQ, SPOOFCHK], ids=["masq", "macspoofchk"])
def test_add_without_libnftables_answers_103_and_leaves_nothing(
    node: Node, options: dict[str, Any]
) -> None:
    conf = bridge_conf(node.data_dir, dual_stack=True, **options)
    pod_ns = node.make_netns("pod")
    missing = "/nonexistent/libnftables.so.1"
    answer = node.call(
        "ADD", conf, container_id="nolib", netns=pod_ns.path, env={LIBRARY_ENV: missing}
    )
    assert answer.error_code == 103, answer
    assert answer.output["msg"].startswith(f"cannot load libnftables ({missing}): "), answer
    assert node.leftovers() == {}
    assert "eth0" not in pod_ns.ip("link")


def test_add_whose_rule_nft_refuses_answers_103_and_leaves_nothing(node: Node) -> None:
    """A chain of the masquerade table's name made by someone else as a filter chain: nft
    refuses to make it a nat chain, so the whole transaction, the pod's rule with it."""
    node.ns.run(
        "nft",
        "add table inet knit_masq { chain postrouting "
        "{ type filter hook postrouting priority 0 ; } ; }",
    )
    conf = bridge_conf(node.data_dir, **MASQ)
    pod_ns = node.make_netns("pod")
    answer = node.call("ADD", conf, container_id="refused", netns=pod_ns.path)
    assert answer.error_code == 103, answer
    assert answer.output["msg"].startswith("nft transaction failed: Error: "), answer
    assert "masquerade" in answer.output["details"], "the refused commands are the details"
    assert node.leftovers() == {}
    assert "eth0" not in pod_ns.ip("link")
    listing = node.ns.run("nft", "list", "chain", "inet", "knit_masq", "postrouting").stdout
    assert "type filter hook postrouting" in listing, "someone else's chain stays as it was"


def test_tagged_rules_are_the_ones_nft_lists_with_its_handles(
    make_netns: Callable[[str], Netns],
) -> None:
    ns = make_netns("knit-nft")
    tags = [Tag("masq", "net", f"c{i}", "eth0") for i in range(3)]
    with ns.entered():
        assert nft_tagged_rules("inet", "knit_masq", "postrouting") == [], "no table, no rules"
        nft_apply(
            "add table inet knit_masq\n"
            "add chain inet knit_masq postrouting "
            "{ type nat hook postrouting priority srcnat; policy accept; }\n"
            + "".join(
                f'add rule {CHAIN} ip saddr 10.0.0.{i} masquerade comment "{tag}"\n'
                for i, tag in enumerate(tags)
            )
            + f'add rule {CHAIN} ip saddr 10.0.1.0 masquerade comment "other"\n'
            + f"add rule {CHAIN} ip saddr 10.0.2.0 masquerade\n"
        )
        found = nft_tagged_rules("inet", "knit_masq", "postrouting")
        assert nft_tagged_rules("inet", "knit_masq", "missing") == []
    listing = ns.run("nft", "-a", "list", "chain", "inet", "knit_masq", "postrouting").stdout
    handles = [
        int(line.rsplit("# handle ", 1)[1]) for line in listing.splitlines() if "comment" in line
    ]
    assert found == list(zip(handles[:3], tags, strict=True))


def test_a_socket_libnftables_cannot_open_is_an_error_not_the_end_of_the_process(
    make_netns: Callable[[str], Netns],
) -> None:
    """libnftables exits when it cannot open its netlink socket; with every descriptor taken,
    the plugin's nft_apply must raise (the plugin then answers 103) and the process go on."""
    script = (
        "import os, resource\n"
        "from cni.kernel.nftables import NftError, nft_apply, nft_tagged_rules\n"
        "from cni.plugin import cni_error\n"
        "nft_apply('add table ip loaded')\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))\n"
        "taken = []\n"
        "while True:\n"
        "    try:\n"
        "        taken.append(os.open('/dev/null', os.O_RDONLY))\n"
        "    except OSError:\n"
        "        break\n"
        "try:\n"
        "    nft_apply('add table ip never')\n"
        "except NftError as err:\n"
        "    print(cni_error(err).code, err.msg)\n"
        "print(nft_tagged_rules('ip', 'loaded', 'c'))\n"
    )
    ns = make_netns("knit-nft")
    done = ns.run(sys.executable, "-c", script, env={"PYTHONPATH": str(ROOT)}, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "103 cannot open a netfilter netlink socket: [Errno 24] Too many open files",
        "[]",
    ]
    assert ns.run("nft", "list", "tables").stdout == "table ip loaded\n"
