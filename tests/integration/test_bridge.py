"""The plugin against the real kernel: pods in namespaces on a node namespace, real packets."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import ClassVar, TypeVar

import pytest
from pyroute2 import IPRoute

import cni.kernel.addresses
from cni.kernel.addresses import RTM_NEWADDR
from cni.kernel.firewall import detect_iptables_flavour
from cni.kernel.rawnetlink import NetlinkSocket
from cni.links import addresses
from deploy.lab.netns import Netns
from deploy.lab.paths import PLUGIN_DIR, REFERENCE_PLUGINS
from deploy.lab.process import eventually
from tests.support.cni_env import UPLINK_NODE, UPLINK_OUTSIDE, Node, bridge_conf
from tests.support.fastpath_daemon import build_launcher, running_daemon


def test_pods_reach_each_other_and_the_gateway(node):
    conf = bridge_conf(node.data_dir)
    pods = [node.add_pod(conf, f"pod{i}") for i in range(3)]
    first = pods[0].result
    assert first["interfaces"][0]["name"] == "kbr0"
    assert first["interfaces"][2] == {
        "name": "eth0",
        "mac": first["interfaces"][2]["mac"],
        "mtu": 1500,
        "sandbox": pods[0].ns.path,
    }
    assert first["ips"] == [{"address": "10.244.1.2/24", "gateway": "10.244.1.1", "interface": 2}]
    assert first["routes"] == [{"dst": "0.0.0.0/0", "gw": "10.244.1.1"}]
    assert [p.address() for p in pods] == ["10.244.1.2", "10.244.1.3", "10.244.1.4"]

    pods[0].ns.serve("0.0.0.0", 8080)
    for client in pods[1:]:
        assert client.ns.request(pods[0].address(), 8080) == client.address()
    node.ns.serve("10.244.1.1", 9090)
    assert pods[2].ns.request("10.244.1.1", 9090) == pods[2].address()
    assert node.ns.run("sysctl", "-n", "net.ipv4.ip_forward").stdout.strip() == "1"


@pytest.mark.parametrize("made_before", [False, True], ids=["new", "made-before"])
def test_the_bridge_keeps_its_mac_as_ports_come_and_go(node, made_before):
    conf = bridge_conf(node.data_dir)
    if made_before:  # as by a version that did not set its MAC, or by hand
        node.ns.run("ip", "link", "add", "kbr0", "type", "bridge")
    first = node.add_pod(conf, "pod0").result["interfaces"][0]["mac"]
    # a port with the lowest MAC there is: a bridge without a MAC of its own would take it
    node.ns.run("ip", "link", "add", "low", "address", "00:00:00:00:00:01", "type", "veth")
    node.ns.run("ip", "link", "set", "low", "master", "kbr0", "up")
    later = node.add_pod(conf, "pod1").result["interfaces"][0]["mac"]
    now = node.ns.run("cat", "/sys/class/net/kbr0/address").stdout.strip()
    assert first == later == now, "pods keep the gateway's MAC they cached"


def test_an_add_leaves_the_nodes_neighbour_entries_for_other_pods(node):
    """Setting the bridge's MAC flushes every neighbour entry on it: an ADD must not, or each
    pod start makes the node resolve every pod of the bridge again."""
    conf = bridge_conf(node.data_dir)
    first = node.add_pod(conf, "pod0")
    node.ns.run("ping", "-c", "1", "-W", "2", first.address())

    def entry() -> str:
        return node.ns.run("ip", "neigh", "show", first.address(), "dev", "kbr0").stdout.strip()

    assert "lladdr" in entry()
    node.add_pod(conf, "pod1")
    assert "lladdr" in entry(), "the node's entry for pod0 survives pod1's ADD"


def test_dual_stack_pods_talk_over_ipv6(node):
    conf = bridge_conf(node.data_dir, dual_stack=True)
    server, client = node.add_pod(conf, "v6-a"), node.add_pod(conf, "v6-b")
    assert server.address(6) == "fd10:244:1::2"
    assert {"dst": "::/0", "gw": "fd10:244:1::1"} in server.result["routes"]
    server.ns.serve("::", 8080)
    assert client.ns.request(server.address(6), 8080) == client.address(6)


@contextmanager
def plugin_path(node: Node, path: str, directory: Path) -> Iterator[Path]:
    """The plugin executable working in-process, or handing its calls to a daemon."""
    if path == "in-process":
        yield PLUGIN_DIR / "knit"
        return
    with running_daemon(node, directory) as daemon:
        yield build_launcher(directory / "fast", daemon.socket_path)
        assert "ADD" in daemon.served(), "the daemon served the ADDs"


def neighbour_macs(ns: Netns, device: str, addresses: list[str]) -> list[str | None]:
    """The MAC each address's neighbour entry on device names (None: no entry)."""
    entries = json.loads(ns.ip("-j", "neigh", "show", "dev", device) or "[]")
    macs = {entry["dst"]: entry.get("lladdr") for entry in entries}
    return [macs.get(address) for address in addresses]


@pytest.mark.parametrize("nud", ["reachable", "stale"])
@pytest.mark.parametrize("path", ["in-process", "fast"])
def test_an_address_given_again_is_announced_to_the_bridge(node, tmp_path, path, nud):
    """A pod given the addresses of one deleted a moment ago: the entries its neighbours on the
    bridge hold for them, naming the old MAC, name the new pod's as ADD returns, and the first
    packet to each gets an answer (with the old MAC it would go unanswered for seconds)."""
    conf = bridge_conf(node.data_dir, dual_stack=True)
    with plugin_path(node, path, tmp_path) as plugin:
        neighbour, old = [node.add_pod(conf, name, plugin=plugin) for name in ("neighbour", "old")]
        addresses = [old.address(4), old.address(6)]
        old_mac = old.result["interfaces"][2]["mac"]
        assert node.call("DEL", conf, old, plugin=plugin).code == 0
        # the node reaches the pod from the bridge's gateway addresses, once IPv6's is out of DAD
        eventually(lambda: not node.ns.ip("-6", "addr", "show", "dev", "kbr0", "tentative"), 10)
        for address in addresses:
            for ns, device in ((neighbour.ns, "eth0"), (node.ns, "kbr0")):
                ns.ip("neigh", "replace", address, "lladdr", old_mac, "dev", device, "nud", nud)
        assert neighbour_macs(neighbour.ns, "eth0", addresses) == [old_mac, old_mac]

        given = {"ips": [f"{addresses[0]}/24", f"{addresses[1]}/64"]}
        new = node.add_pod({**conf, "runtimeConfig": given}, "new", plugin=plugin)
        new_mac = new.result["interfaces"][2]["mac"]
        assert [new.address(4), new.address(6)] == addresses
        assert neighbour_macs(neighbour.ns, "eth0", addresses) == [new_mac, new_mac]
        # the node's own entries are gone: ADD deletes them before the pod can answer
        assert old_mac not in neighbour_macs(node.ns, "kbr0", addresses)
        for ns in (neighbour.ns, node.ns):
            for address in addresses:
                ns.run("ping", "-c", "1", "-W", "1", address)


@pytest.mark.parametrize("version", ["0.3.0", "0.3.1", "0.4.0", "1.0.0"])
def test_result_is_printed_in_the_requested_version(node, version):
    pod = node.add_pod({**bridge_conf(node.data_dir), "cniVersion": version}, "versioned")
    assert pod.result["cniVersion"] == version
    assert ("version" in pod.result["ips"][0]) == (version != "1.0.0")
    assert "mtu" not in pod.result["interfaces"][2]


@pytest.mark.parametrize("backend", ["iptables", "nftables"])
def test_masquerade_to_outside_and_removal_on_del(node, make_netns, backend):
    outside = make_netns("outside")
    node.connect_outside(outside)
    conf = bridge_conf(node.data_dir, ipMasq=True, ipMasqBackend=backend)
    pod, peer = node.add_pod(conf, "masq-a"), node.add_pod(conf, "masq-b")
    outside.serve("0.0.0.0", 8080)
    assert pod.ns.request(UPLINK_OUTSIDE, 8080) == UPLINK_NODE
    peer.ns.serve("0.0.0.0", 8081)
    assert pod.ns.request(peer.address(), 8081) == pod.address(), "pod-to-pod is not NATed"
    assert len([r for r in node.knit_rules() if "masq-a" in r]) >= 1
    assert legacy_tables(node.ns) == "", "finding the node's iptables flavour created none"

    assert node.call("DEL", conf, pod).code == 0
    assert not [r for r in node.knit_rules() if "masq-a" in r]
    assert [r for r in node.knit_rules() if "masq-b" in r]
    assert not pod.ns.reaches(UPLINK_OUTSIDE, 8080)


def legacy_tables(ns: Netns) -> str:
    """The legacy xtables tables that exist in ns."""
    names = "/proc/net/ip_tables_names /proc/net/ip6_tables_names"
    return ns.run("sh", "-c", f"cat {names} 2>/dev/null", check=False).stdout


@pytest.mark.parametrize("hinted", ["nft", "legacy"])
def test_kubelets_hint_chain_decides_the_iptables_flavour(make_netns, hinted):
    ns = make_netns("flavour")
    ns.run(f"iptables-{hinted}", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT")
    other = "legacy" if hinted == "nft" else "nft"
    for _ in range(3):
        ns.run(f"iptables-{other}", "-A", "INPUT", "-j", "ACCEPT")
    with ns.entered():
        assert detect_iptables_flavour() == hinted, "the hint wins over the other's more rules"


def test_a_hints_answer_is_kept_for_its_namespace_a_counts_is_not(make_netns):
    hinted, counted = make_netns("flavour"), make_netns("flavour")
    hinted.run("iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT")
    with hinted.entered():
        assert detect_iptables_flavour() == "legacy"
    hinted.run("iptables-legacy", "-t", "mangle", "-X", "KUBE-IPTABLES-HINT")
    with hinted.entered():
        assert detect_iptables_flavour() == "legacy", "kept, though the hint is gone"
    counted.run("iptables-legacy", "-A", "INPUT", "-j", "ACCEPT")
    with counted.entered():
        assert detect_iptables_flavour() == "legacy", "more legacy rules, no hint"
    counted.run("iptables-nft", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT")
    with counted.entered():
        assert detect_iptables_flavour() == "nft", "kubelet's hint, once made, decides"


def test_a_fresh_node_is_nft_and_keeps_no_legacy_table(make_netns):
    ns = make_netns("flavour")
    with ns.entered():
        assert detect_iptables_flavour() == "nft"
    assert legacy_tables(ns) == ""


def test_check_passes_then_names_what_is_missing(node):
    conf = bridge_conf(node.data_dir)
    pod = node.add_pod(conf, "checked")
    checked = node.with_prev(conf, pod)
    assert node.call("CHECK", checked, pod).code == 0

    pod.ns.run("ip", "route", "del", "default")
    answer = node.call("CHECK", checked, pod)
    assert (
        answer.code == 1 and "route to 0.0.0.0/0 via 10.244.1.1 is missing" in answer.output["msg"]
    )

    pod.ns.run("ip", "addr", "del", "10.244.1.2/24", "dev", "eth0")
    assert "address 10.244.1.2/24 is missing" in node.call("CHECK", checked, pod).output["msg"]

    host_veth = pod.result["interfaces"][1]["name"]
    node.ns.run("ip", "link", "set", host_veth, "nomaster")
    assert "not attached to bridge kbr0" in node.call("CHECK", checked, pod).output["msg"]
    node.ns.run("ip", "link", "del", host_veth)
    assert f"host veth {host_veth} is missing" in node.call("CHECK", checked, pod).output["msg"]


def test_check_looks_for_a_route_in_its_table(node):
    conf = bridge_conf(node.data_dir)
    conf["ipam"]["routes"] = [{"dst": "10.99.0.0/16", "table": 100}]
    pod = node.add_pod(conf, "table-check")
    assert {"dst": "10.99.0.0/16", "gw": "10.244.1.1", "table": 100} in pod.result["routes"]
    checked = node.with_prev(conf, pod)
    assert node.call("CHECK", checked, pod).code == 0

    pod.ns.run("ip", "route", "del", "10.99.0.0/16", "table", "100")
    pod.ns.run("ip", "route", "add", "10.99.0.0/16", "via", "10.244.1.1")
    answer = node.call("CHECK", checked, pod)
    assert "route to 10.99.0.0/16 via 10.244.1.1 is missing" in answer.output["msg"], answer


def test_check_catches_a_changed_mac(node):
    conf = bridge_conf(node.data_dir)
    pod = node.add_pod(conf, "mac-check")
    pod.ns.run("ip", "link", "set", "eth0", "address", "02:00:00:00:00:99")
    answer = node.call("CHECK", node.with_prev(conf, pod), pod)
    assert "has MAC 02:00:00:00:00:99" in answer.output["msg"]


def test_del_is_idempotent_and_survives_a_missing_netns(node, make_netns):
    conf = bridge_conf(node.data_dir, ipMasq=True)
    pod = node.add_pod(conf, "del-1")
    assert node.call("DEL", conf, pod).code == 0
    assert node.call("DEL", conf, pod).code == 0
    assert node.leftovers() == {}

    gone = node.add_pod(conf, "del-2")
    gone.ns.remove()
    answer = node.call("DEL", conf, gone)
    assert answer.code == 0 and answer.output is None
    assert node.leftovers() == {}

    empty = node.add_pod(conf, "del-3")
    assert node.call("DEL", conf, empty, netns="").code == 0
    assert node.leftovers() == {}, "an empty CNI_NETNS still releases the IP and the veth"

    missing_if = node.add_pod(conf, "del-4")
    missing_if.ns.run("ip", "link", "del", "eth0")
    assert node.call("DEL", conf, missing_if).code == 0
    assert node.leftovers() == {}


def with_range(conf, **range_options):
    """conf with its single range changed, e.g. to an invalid subnet."""
    ipam = conf["ipam"]
    return {**conf, "ipam": {**ipam, "ranges": [[{**ipam["ranges"][0][0], **range_options}]]}}


def test_bad_input_gets_the_right_code_and_leaves_nothing(node, make_netns):
    conf = bridge_conf(node.data_dir, ipMasq=True)
    pod_ns = make_netns("pod")
    add = {"container_id": "bad", "netns": pod_ns.path}
    cases = [
        (6, node.call("ADD", b"{not json", **add)),
        (4, node.call("ADD", conf, container_id="bad")),
        (1, node.call("ADD", {**conf, "cniVersion": "0.2.0"}, **add)),
        (7, node.call("ADD", with_range(conf, subnet="10.244.1.0/33"), **add)),
        (7, node.call("ADD", with_range(conf, rangeStart="10.9.9.9"), **add)),
        (4, node.call("ADD", conf, ifname="a-very-long-ifname", **add)),
        (2, node.call("ADD", {**conf, "hairpinmode": True}, **add)),
        (3, node.call("ADD", conf, container_id="bad", netns="/var/run/netns/no-such-ns")),
    ]
    for expected, answer in cases:
        assert answer.code == 1, answer
        assert answer.output["code"] == expected, answer.output
        assert answer.output["cniVersion"]
    missing = node.call("ADD", conf, container_id="bad")
    assert "CNI_NETNS" in missing.output["msg"]

    pod_ns.run("ip", "link", "add", "eth0", "type", "veth", "peer", "name", "other")
    exists = node.call("ADD", conf, **add)
    assert exists.output["code"] == 100 and "eth0 already exists" in exists.output["msg"]
    assert node.leftovers() == {}


def test_failure_half_way_rolls_everything_back(node):
    conf = bridge_conf(node.data_dir, ipMasq=True)
    conf["ipam"]["routes"] = [{"dst": "10.99.0.0/16", "gw": "192.0.2.1"}]
    pod_ns = node.make_netns("pod")
    answer = node.call("ADD", conf, container_id="half", netns=pod_ns.path)
    assert answer.code == 1 and "cannot configure eth0" in answer.output["msg"]
    assert node.leftovers() == {}
    assert "eth0" not in pod_ns.ip("link")


def test_32_concurrent_adds_get_32_addresses(node):
    conf = bridge_conf(node.data_dir)
    pod_namespaces = [node.make_netns("pod") for _ in range(32)]

    def add(i):
        return node.call("ADD", conf, container_id=f"c{i}", netns=pod_namespaces[i].path)

    with ThreadPoolExecutor(max_workers=32) as pool:
        answers = list(pool.map(add, range(32)))
    assert all(a.code == 0 for a in answers), [a for a in answers if a.code]
    addresses = {a.output["ips"][0]["address"] for a in answers}
    assert len(addresses) == 32
    assert len(node.reservations()) == 32

    def delete(i):
        return node.call("DEL", conf, container_id=f"c{i}", netns=pod_namespaces[i].path)

    with ThreadPoolExecutor(max_workers=32) as pool:
        assert all(a.code == 0 for a in pool.map(delete, range(32)))
    assert node.leftovers() == {}


def test_gc_removes_what_is_not_valid(node):
    conf = bridge_conf(node.data_dir, ipMasq=True)
    keep = node.add_pod(conf, "keep")
    for name in ("stale1", "stale2"):
        node.add_pod(conf, name)
    node.add_pod(bridge_conf(node.data_dir, ipMasq=True, ipMasqBackend="nftables"), "stale3")
    before = node.knit_rules()
    assert any("id=stale3" in r and "masquerade" in r for r in before), "an nft rule to collect"
    assert any("id=stale1" in r and "KNIT-MASQ-" in r for r in before), "an iptables rule too"
    gc = {**conf, "cni.dev/valid-attachments": [{"containerID": "keep", "ifname": "eth0"}]}
    answer = node.call("GC", gc)
    assert answer.code == 0, answer
    assert node.reservations() == [keep.address()]
    rules = node.knit_rules()
    assert rules and all("id=keep" in r for r in rules)

    legacy_key = {**conf, "cni.dev/attachments": []}
    assert node.call("GC", legacy_key).code == 0
    assert node.reservations() == []
    assert node.knit_rules() == []


def test_status_reports_exhaustion_and_an_unusable_data_dir(node, tmp_path):
    small = bridge_conf(node.data_dir)
    small["ipam"]["ranges"] = [[{"subnet": "10.244.1.0/30"}]]
    assert node.call("STATUS", small).code == 0
    node.add_pod(small, "only")
    assert node.call("STATUS", small).output["code"] == 50
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    assert node.call("STATUS", bridge_conf(blocker)).output["code"] == 50


def test_version_lists_supported_versions(node):
    answer = node.call("VERSION", b'{"cniVersion": "1.0.0"}')
    assert answer.output == {
        "cniVersion": "1.0.0",
        "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"],
    }


def test_mtu_hairpin_and_promisc(node):
    conf = bridge_conf(node.data_dir, mtu=1400, hairpinMode=True)
    pod = node.add_pod(conf, "opts")
    assert "mtu 1400" in pod.ns.ip("link", "show", "eth0")
    host_veth = pod.result["interfaces"][1]["name"]
    details = json.loads(node.ns.run("ip", "-d", "-j", "link", "show", host_veth).stdout)[0]
    assert details["linkinfo"]["info_slave_data"]["hairpin"] is True
    assert details["mtu"] == 1400

    promisc = bridge_conf(node.data_dir, promiscMode=True)
    node.add_pod(promisc, "promisc")
    assert "PROMISC" in node.ns.ip("link", "show", "kbr0")


def link_flags(ns: Netns, name: str) -> list[str]:
    return json.loads(ns.run("ip", "-j", "link", "show", name).stdout)[0]["flags"]


def test_promisc_mode_on_a_new_bridge_leaves_it_up(node):
    pod = node.add_pod(bridge_conf(node.data_dir, promiscMode=True), "promisc-first")
    assert {"UP", "PROMISC"} <= set(link_flags(node.ns, "kbr0"))
    node.ns.serve("10.244.1.1", 9090)
    assert pod.ns.request("10.244.1.1", 9090) == pod.address()


def global_addresses(ns: Netns, name: str) -> list[str]:
    info = json.loads(ns.run("ip", "-j", "addr", "show", name).stdout)[0]["addr_info"]
    return [a["local"] for a in info if a["scope"] != "link"]


def test_without_an_ipam_type_a_pod_gets_a_layer_2_port(node):
    conf = {**bridge_conf(node.data_dir, ipMasq=True), "ipam": {}}
    pods = [node.add_pod(conf, f"l2-{i}") for i in range(2)]
    result = pods[0].result
    assert [i["name"] for i in result["interfaces"]][::2] == ["kbr0", "eth0"]
    assert "ips" not in result and "routes" not in result
    assert global_addresses(node.ns, "kbr0") == [], "isGateway needs addresses to set"
    assert node.knit_rules() == [], "ipMasq needs addresses to masquerade"
    for i, pod in enumerate(pods):
        assert "UP" in link_flags(pod.ns, "eth0")
        assert global_addresses(pod.ns, "eth0") == []
        assert pod.ns.ip("-4", "route") == "" and "default" not in pod.ns.ip("-6", "route")
        pod.ns.run("ip", "addr", "add", f"192.0.2.{i + 1}/24", "dev", "eth0")
    pods[0].ns.serve("192.0.2.1", 8080)
    assert pods[1].ns.request("192.0.2.1", 8080) == "192.0.2.2", "the bridge carries frames"
    for pod in pods:
        pod.ns.run("ip", "addr", "flush", "dev", "eth0")
        assert node.call("CHECK", node.with_prev(conf, pod), pod).code == 0
        assert node.call("DEL", node.with_prev(conf, pod), pod).code == 0
        assert "eth0" not in pod.ns.ip("link")
    assert node.leftovers() == {}


def test_cni_args_mac_comes_after_args_and_runtime_config(node, make_netns):
    macs = ["0a:58:00:00:00:01", "0a:58:00:00:00:02", "0a:58:00:00:00:03"]
    cni_args = f"IgnoreUnknown=1;K8S_POD_NAME=p;MAC={macs[0]}"
    confs = [
        bridge_conf(node.data_dir),
        bridge_conf(node.data_dir, args={"cni": {"mac": macs[1]}}),
        bridge_conf(node.data_dir, args={"cni": {"mac": macs[1]}}, runtimeConfig={"mac": macs[2]}),
    ]
    for i, (conf, mac) in enumerate(zip(confs, macs, strict=True)):
        pod_ns = make_netns("pod")
        answer = node.call("ADD", conf, container_id=f"mac{i}", netns=pod_ns.path, args=cni_args)
        assert answer.code == 0, answer
        assert answer.output["interfaces"][2]["mac"] == mac
        assert f"link/ether {mac}" in pod_ns.ip("link", "show", "eth0")


def test_the_configs_dns_replaces_ipams(node, tmp_path):
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 10.0.0.53\nsearch from-ipam\n")
    conf = bridge_conf(node.data_dir)
    conf["ipam"]["resolvConf"] = str(resolv)
    assert node.add_pod(conf, "dns-ipam").result["dns"] == {
        "nameservers": ["10.0.0.53"],
        "search": ["from-ipam"],
    }
    dns = {"nameservers": ["10.96.0.10"], "domain": "cluster.local", "options": ["ndots:5"]}
    assert node.add_pod({**conf, "dns": dns}, "dns-conf").result["dns"] == dns


def test_hairpin_lets_a_pod_reach_itself_through_the_node(node):
    conf = bridge_conf(node.data_dir, hairpinMode=True)
    pod = node.add_pod(conf, "hairpin")
    node.ns.run(
        "iptables",
        "-t",
        "nat",
        "-A",
        "PREROUTING",
        "-d",
        "10.244.1.1",
        "-p",
        "tcp",
        "--dport",
        "7070",
        "-j",
        "DNAT",
        "--to-destination",
        f"{pod.address()}:8080",
    )
    node.ns.run(
        "iptables",
        "-t",
        "nat",
        "-A",
        "POSTROUTING",
        "-s",
        pod.address(),
        "-d",
        pod.address(),
        "-j",
        "MASQUERADE",
    )
    node.ns.run("sysctl", "-w", "net.bridge.bridge-nf-call-iptables=1")
    pod.ns.serve("0.0.0.0", 8080)
    assert pod.ns.reaches("10.244.1.1", 7070)


def test_macspoofchk_drops_frames_from_another_mac(node):
    conf = bridge_conf(node.data_dir, macspoofchk=True)
    pod = node.add_pod(conf, "spoof")
    node.ns.serve("10.244.1.1", 9090)
    assert pod.ns.reaches("10.244.1.1", 9090)
    assert any("id=spoof" in r for r in node.knit_rules())
    pod.ns.run("ip", "link", "set", "eth0", "address", "02:00:00:00:00:42")
    pod.ns.run("ip", "neigh", "flush", "all")
    assert not pod.ns.reaches("10.244.1.1", 9090)
    assert node.call("DEL", conf, pod).code == 0
    assert node.leftovers() == {}


def test_force_address_replaces_a_clashing_bridge_address(node):
    node.ns.run("ip", "link", "add", "kbr0", "type", "bridge")
    node.ns.run("ip", "addr", "add", "10.244.1.200/24", "dev", "kbr0")
    conf = bridge_conf(node.data_dir)
    pod_ns = node.make_netns("pod")
    answer = node.call("ADD", conf, container_id="force", netns=pod_ns.path)
    assert answer.output["code"] == 7 and "forceAddress" in answer.output["msg"]
    assert node.leftovers() == {}
    node.add_pod(bridge_conf(node.data_dir, forceAddress=True), "force")
    addresses = node.ns.ip("-4", "addr", "show", "kbr0")
    assert "10.244.1.1/24" in addresses and "10.244.1.200" not in addresses


def test_vlan_is_refused_cleanly_by_a_kernel_without_bridge_vlan_filtering(node):
    """This kernel lacks CONFIG_BRIDGE_VLAN_FILTERING: the option is proven only this far."""
    probe = node.ns.run(
        "ip", "link", "add", "vlanprobe", "type", "bridge", "vlan_filtering", "1", check=False
    )
    if probe.returncode == 0:
        pytest.skip("kernel has bridge VLAN filtering; covered where it is missing")
    conf = bridge_conf(node.data_dir, vlan=100, isGateway=False, isDefaultGateway=False)
    pod_ns = node.make_netns("pod")
    answer = node.call("ADD", conf, container_id="vlan", netns=pod_ns.path)
    assert answer.output["code"] == 101 and "cannot create bridge kbr0" in answer.output["msg"]
    assert node.leftovers() == {}


def test_other_ipam_types_are_delegated_through_cni_path(node, tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "ref-host-local").symlink_to(REFERENCE_PLUGINS / "host-local")
    env = {"CNI_PATH": f"{PLUGIN_DIR}:{plugins}"}
    conf = bridge_conf(node.data_dir)
    conf["ipam"]["type"] = "ref-host-local"
    pod_ns = node.make_netns("pod")
    answer = node.call("ADD", conf, container_id="delegated", netns=pod_ns.path, env=env)
    assert answer.code == 0, answer
    assert answer.output["ips"][0]["address"] == "10.244.1.2/24"
    assert node.reservations() == ["10.244.1.2"]

    ours = node.add_pod(bridge_conf(node.data_dir), "in-process")
    assert ours.address() == "10.244.1.3", "both allocators share one dataDir and its lock"
    assert node.call("DEL", conf, container_id="delegated", netns=pod_ns.path, env=env).code == 0
    assert node.reservations() == ["10.244.1.3"]

    missing = {**conf, "ipam": {**conf["ipam"], "type": "no-such-ipam"}}
    answer = node.call("ADD", missing, container_id="x", netns=node.make_netns("pod").path)
    assert answer.output["code"] == 104 and "no-such-ipam" in answer.output["msg"]


T = TypeVar("T")


class AddressMessagesCounted(NetlinkSocket):
    """A netlink socket counting the address messages the kernel sends for each dump, before
    the reader's own filtering."""

    received: ClassVar[list[int]] = []

    def dump(self, kind: int, body: bytes, keep: Callable[[int, memoryview], T | None]) -> list[T]:
        sent = 0

        def counted(message_kind: int, payload: memoryview) -> T | None:
            nonlocal sent
            sent += message_kind == RTM_NEWADDR
            return keep(message_kind, payload)

        kept = super().dump(kind, body, counted)
        self.received.append(sent)
        return kept


def test_a_links_addresses_are_its_own_among_many_of_another(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    node.ns.run("ip", "link", "add", "name", "svc0", "type", "veth", "peer", "name", "svc1")
    batch = "".join(f"addr add 10.96.0.{i}/32 dev svc0\n" for i in range(1, 200))
    batch += "addr add 192.0.2.1/24 dev svc1\naddr add 2001:db8::1/64 dev svc1 nodad\n"
    batch += "addr add 203.0.113.1 peer 203.0.113.2 dev svc1\n"
    batch += "addr add 169.254.0.1/16 dev svc1 scope link\n"
    node.ns.run("ip", "-batch", "-", stdin=batch)
    monkeypatch.setattr(cni.kernel.addresses, "NetlinkSocket", AddressMessagesCounted)
    monkeypatch.setattr(AddressMessagesCounted, "received", [])
    with node.ns.entered(), IPRoute() as ipr:
        index = ipr.link_lookup(ifname="svc1")[0]
        found = sorted(map(str, addresses(index)))
    assert found == ["192.0.2.1/24", "2001:db8::1/64", "203.0.113.1/32"], "global, own end"
    assert AddressMessagesCounted.received == [4], "the kernel sent only the link's addresses"
