"""DEL and GC are best effort: a packet filter backend or address family the attachment never
used, missing or broken on the node (iptables or libnftables not installed, ip6tables broken),
does not make them fail. DEL removes every kind of rule the attachment has."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cni.kernel.nftables import LIBRARY_ENV
from cni.netconf import MASQ_BACKENDS
from tests.support.cni_env import bridge_conf


def only_binaries(directory: Path, *names: str) -> str:
    """A PATH holding nothing but the named binaries: a node without the others."""
    directory.mkdir()
    for name in names:
        found = shutil.which(name)
        assert found is not None, f"{name} is needed to run this test"
        (directory / name).symlink_to(found)
    return str(directory)


IP6TABLES = ("ip6tables-nft", "ip6tables-legacy", "ip6tables-legacy-save")
"""What lists IPv6 rules in either flavour (legacy lists a chain with its save): teardown
lists before it writes, so these failing is enough to fail it."""


def failing_before_path(directory: Path, *names: str) -> str:
    """The PATH with the named binaries replaced by ones that always fail."""
    directory.mkdir()
    for name in names:
        (directory / name).write_text(f"#!/bin/sh\necho '{name}: broken here' >&2\nexit 1\n")
        (directory / name).chmod(0o755)
    return f"{directory}:{os.environ['PATH']}"


def test_gc_on_a_node_without_iptables(node, tmp_path):
    masq = bridge_conf(node.data_dir, ipMasq=True, ipMasqBackend="nftables")
    kept = node.add_pod(masq, "kept")
    node.add_pod(masq, "stale")
    gc = {
        **bridge_conf(node.data_dir),
        "cni.dev/valid-attachments": [{"containerID": "kept", "ifname": "eth0"}],
    }
    answer = node.call("GC", gc, env={"PATH": only_binaries(tmp_path / "bin", "ip")})
    assert answer.code == 0, answer
    assert node.reservations() == [kept.address()]
    rules = node.knit_rules()
    assert rules and all("id=kept" in r for r in rules)


def test_gc_on_a_node_without_libnftables(node):
    conf = bridge_conf(node.data_dir, ipMasq=True)
    kept = node.add_pod(conf, "kept")
    node.add_pod(conf, "stale")
    gc = {**conf, "cni.dev/valid-attachments": [{"containerID": "kept", "ifname": "eth0"}]}
    answer = node.call("GC", gc, env={LIBRARY_ENV: "/nonexistent/libnftables.so.1"})
    assert answer.code == 0, answer
    assert node.reservations() == [kept.address()]
    rules = node.knit_rules()
    assert rules and all("id=kept" in r for r in rules)


def test_del_of_an_ipv4_attachment_leaves_ipv6_alone(node, tmp_path):
    conf = bridge_conf(node.data_dir, ipMasq=True)
    pod = node.add_pod(conf, "v4-only")
    broken = failing_before_path(tmp_path / "bin", *IP6TABLES)
    answer = node.call("DEL", node.with_prev(conf, pod), pod, env={"PATH": broken})
    assert answer.code == 0, answer
    assert node.leftovers() == {}


def test_del_still_reports_a_family_the_attachment_used(node, tmp_path):
    conf = bridge_conf(node.data_dir, dual_stack=True, ipMasq=True)
    pod = node.add_pod(conf, "dual")
    broken = failing_before_path(tmp_path / "bin", *IP6TABLES)
    answer = node.call("DEL", node.with_prev(conf, pod), pod, env={"PATH": broken})
    assert answer.error_code == 103 and "broken here" in answer.output["msg"], answer
    assert node.reservations() == [], "the rest of DEL ran"
    assert node.call("DEL", conf, pod).code == 0
    assert node.leftovers() == {}


@pytest.mark.parametrize("backend", MASQ_BACKENDS)
def test_del_removes_both_the_masquerade_and_the_spoof_check_rules(node, backend):
    conf = bridge_conf(node.data_dir, ipMasq=True, ipMasqBackend=backend, macspoofchk=True)
    pod = node.add_pod(conf, "both")
    assert node.call("DEL", node.with_prev(conf, pod), pod).code == 0
    assert node.leftovers() == {}


def test_legacy_teardown_creates_no_table(node):
    node.ns.run("iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT")
    conf = bridge_conf(node.data_dir, ipMasq=True)
    pod = node.add_pod(conf, "legacy")
    assert "KNIT-MASQ-" in node.ns.run("iptables-legacy-save", "-t", "nat").stdout
    assert node.call("DEL", conf, pod).code == 0
    assert node.call("GC", {**conf, "cni.dev/valid-attachments": []}).code == 0
    assert "KNIT-MASQ-" not in node.ns.run("iptables-legacy-save", "-t", "nat").stdout
    ipv6_tables = node.ns.run("cat", "/proc/net/ip6_tables_names", check=False).stdout
    assert "nat" not in ipv6_tables, "asking legacy ip6tables for nat would have created it"
