"""A cluster of node namespaces running knit-proxyd: pod routes across nodes (directly on one
segment, over VXLAN between segments), Services whose backends are elsewhere, NodePorts from
outside, egress masquerade, nodes joining and leaving, the CNI config, GC after a reboot.

Two underlay segments joined by a router: nodes a and b share lan1 (routed directly), node c
is on lan2 (reached over VXLAN). The daemons install the plugin from a bundle and pods are
attached through libcni with each node's own config and plugin directory.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.lab.cluster import Cluster, LabNode
from deploy.lab.controlplane import ControlPlane
from deploy.lab.kube import NODES
from deploy.lab.netns import unique_name
from deploy.lab.process import eventually, in_ns
from proxyd.nodenet.route_plan import vtep_address
from proxyd.nodenet.routes import ROUTE_PROTOCOL, VXLAN_DEVICE
from proxyd.nodenet.source_nat import EGRESS_CHAIN, PEER_CHAIN
from proxyd.policy.render import TABLE as POLICY_TABLE

APPLIED = "node networking in place for"
POD_CIDRS = {
    "a": ("10.244.1.0/24", "fd10:244:0:1::/64"),
    "b": ("10.244.2.0/24", "fd10:244:0:2::/64"),
    "c": ("10.244.3.0/24", "fd10:244:0:3::/64"),
    "d": ("10.244.4.0/24", "fd10:244:0:4::/64"),
}


@pytest.fixture(scope="module")
def cluster(
    control_plane: ControlPlane, cni_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    folder = tmp_path_factory.mktemp("cluster") / "lab"
    with Cluster(unique_name("kc"), folder, control_plane, cni_bundle) as lab:
        lan1 = lab.add_segment("lan1", "10.77.1.0/24", "fd77:1::/64")
        lan2 = lab.add_segment("lan2", "10.77.2.0/24", "fd77:2::/64")
        lab.add_node("a", lan1, 11, POD_CIDRS["a"])
        lab.add_node("b", lan1, 12, POD_CIDRS["b"])
        lab.add_node("c", lan2, 13, POD_CIDRS["c"])
        lab.add_host("outside", lan2, 99)
        yield lab


def knit_routes(node: LabNode, family: int = 4) -> dict[str, str]:
    """Destination -> "via X dev Y" of the node's routes with knit's protocol number."""
    out = in_ns(node.ns, "ip", "-j", f"-{family}", "route", "show", "proto", str(ROUTE_PROTOCOL))
    return {r["dst"]: f"via {r['gateway']} dev {r['dev']}" for r in json.loads(out or "[]")}


def routed(node: LabNode, expected: dict[str, str], family: int = 4) -> bool:
    return knit_routes(node, family) == expected


def test_the_daemon_writes_the_cni_config_and_installs_the_plugin(cluster: Cluster) -> None:
    for node in cluster.nodes.values():
        conflist = json.loads(eventually(what="conflist", check=node.conflist.read_text))
        knit, portmap = conflist["plugins"]
        assert conflist["name"] == "knit" and knit["type"] == "knit"
        assert [r[0]["subnet"] for r in knit["ipam"]["ranges"]] == list(node.pod_cidrs)
        assert knit["ipam"]["dataDir"] == str(node.data_dir)
        assert knit["mtu"] == 1500 - 50  # auto routing may use VXLAN over IPv4
        assert portmap == {"type": "portmap", "capabilities": {"portMappings": True}}
        assert os.access(node.bin_dir / "knit", os.X_OK)
        assert not [p for p in node.conflist.parent.iterdir() if p.name.startswith(".")]


def test_routes_go_direct_on_a_segment_and_over_vxlan_between_segments(cluster: Cluster) -> None:
    a, b, c = (cluster.nodes[n] for n in "abc")
    vtep_c = vtep_address(POD_CIDRS["c"][0])
    expected = {
        POD_CIDRS["b"][0]: f"via {b.addresses[0]} dev eth0",
        POD_CIDRS["c"][0]: f"via {vtep_c} dev {VXLAN_DEVICE}",
    }
    eventually(what="a's IPv4 routes", check=lambda: routed(a, expected))
    eventually(
        what="a's IPv6 routes",
        check=lambda: routed(
            a,
            {
                POD_CIDRS["b"][1]: f"via {b.addresses[1]} dev eth0",
                POD_CIDRS["c"][1]: f"via {vtep_address(POD_CIDRS['c'][1])} dev {VXLAN_DEVICE}",
            },
            6,
        ),
    )
    eventually(
        what="c's IPv4 routes, all over VXLAN",
        check=lambda: routed(
            c,
            {
                cidr: f"via {vtep_address(cidr)} dev {VXLAN_DEVICE}"
                for cidr in (POD_CIDRS["a"][0], POD_CIDRS["b"][0])
            },
        ),
    )


@pytest.mark.parametrize("family", [4, 6])
def test_pod_to_pod_across_nodes_keeps_the_pod_address(cluster: Cluster, family: int) -> None:
    a, b, c = (cluster.nodes[n] for n in "abc")
    client = cluster.add_pod(a, unique_name("client"))
    for node in (a, b, c):
        server = cluster.add_pod(node, unique_name(f"web-{node.name}"))
        seen, label = cluster.request(client.ns, server.address(family))
        assert (seen, label) == (client.address(family), server.address(family)), node.name


def test_clusterip_with_backends_on_other_nodes(cluster: Cluster) -> None:
    a, b, c = (cluster.nodes[n] for n in "abc")
    backends = [cluster.add_pod(node, unique_name(f"be-{node.name}")) for node in (b, c)]
    # the installed plugin handed the ADD to the node's daemon (the fast path), which logs it
    # after it answered
    eventually(
        what="b's line for the ADD",
        check=lambda: f"CNI ADD {backends[0].ns}/eth0: exit 0" in b.log.read_text(),
    )
    service = cluster.publish(unique_name("svc"), backends)
    client = cluster.add_pod(a, unique_name("client"))
    for cluster_ip in service["spec"]["clusterIPs"]:
        answered = set()
        deadline = time.monotonic() + 30
        while len(answered) < 2 and time.monotonic() < deadline:
            seen, label = cluster.request(client.ns, cluster_ip, wait=0)
            if label:
                assert seen == client.address(6 if ":" in cluster_ip else 4)
                answered.add(label)
        assert answered == {b.address(6 if ":" in cluster_ip else 4) for b in backends}


def test_nodeport_from_an_outside_host(cluster: Cluster) -> None:
    b, c = cluster.nodes["b"], cluster.nodes["c"]
    backend = cluster.add_pod(c, unique_name("np"))
    service = cluster.publish(unique_name("np"), [backend], type="NodePort")
    node_port = service["spec"]["ports"][0]["nodePort"]
    outside = f"{cluster.prefix}-outside"
    # b holds no backend: the connection goes on to c, masqueraded (eTP Cluster) to the address
    # b sends from over the overlay, its VTEP address, which c turns into b's own on arrival
    seen, label = cluster.request(outside, b.addresses[0], node_port)
    assert (seen, label) == (b.addresses[0], backend.address(4))


@contextlib.contextmanager
def strict_reverse_path(nodes: list[LabNode]) -> Iterator[None]:
    """Strict reverse-path filtering on the nodes (as RHEL sets it) while the block runs."""
    setting = "net.ipv4.conf.all.rp_filter"
    for node in nodes:
        in_ns(node.ns, "sysctl", "-qw", f"{setting}=1")
    try:
        yield
    finally:
        for node in nodes:
            in_ns(node.ns, "sysctl", "-qw", f"{setting}=0")


def test_a_nodes_own_traffic_over_vxlan_reaches_pods_from_its_address(cluster: Cluster) -> None:
    a, c = cluster.nodes["a"], cluster.nodes["c"]
    backend = cluster.add_pod(c, unique_name("own"))
    service = cluster.publish(
        unique_name("own"), [backend], type="NodePort", externalTrafficPolicy="Local"
    )
    node_port = service["spec"]["ports"][0]["nodePort"]
    with strict_reverse_path([a, c]):
        # a sends from its VTEP address, so both sides route and check it on the overlay
        seen, label = cluster.request(a.ns, backend.address(4))
        assert (seen, label) == (a.addresses[0], backend.address(4))
        # a's own Local NodePort: the node's connection goes to the endpoint on c all the
        # same, masqueraded, and the endpoint sees a's address (what kube-proxy gives over
        # direct routes, and what the upstream e2e spec of eTP changes expects)
        seen, label = cluster.request(a.ns, a.addresses[0], node_port)
        assert (seen, label) == (a.addresses[0], backend.address(4))


def test_egress_is_masqueraded_and_pod_traffic_is_not(cluster: Cluster) -> None:
    a = cluster.nodes["a"]
    outside = f"{cluster.prefix}-outside"
    cluster.serve(outside, 8080, a.folder / "outside-echo.log")
    pod = cluster.add_pod(a, unique_name("egress"))
    for family, outside_ip in ((4, "10.77.2.99"), (6, "fd77:2::63")):
        seen, _ = cluster.request(pod.ns, outside_ip, 8080)
        assert seen == a.addresses[0 if family == 4 else 1]


def test_a_node_joining_and_leaving_moves_the_routes(cluster: Cluster) -> None:
    a = cluster.nodes["a"]
    lan1 = a.segment
    eventually(what="a's routes to b and c", check=lambda: len(knit_routes(a)) == 2)
    before = knit_routes(a)
    d = cluster.add_node("d", lan1, 14, ())
    assert not d.conflist.exists()
    cluster.kube.patch(
        f"{NODES}/d", {"spec": {"podCIDR": POD_CIDRS["d"][0], "podCIDRs": list(POD_CIDRS["d"])}}
    )
    eventually(what="d's CNI config once it has a podCIDR", check=d.conflist.exists)
    d.pod_cidrs = POD_CIDRS["d"]
    eventually(
        what="a's route to d",
        check=lambda: knit_routes(a).get(POD_CIDRS["d"][0]) == f"via {d.addresses[0]} dev eth0",
    )
    pod_d = cluster.add_pod(d, unique_name("on-d"))
    client = cluster.add_pod(a, unique_name("to-d"))
    assert cluster.request(client.ns, pod_d.address()) == (client.address(), pod_d.address())
    cluster.remove_node(d)
    eventually(what="a's route to d removed", check=lambda: knit_routes(a) == before)


def test_cleanup_removes_routes_overlay_and_egress(cluster: Cluster) -> None:
    c = cluster.nodes["c"]
    eventually(what="c's node networking", check=lambda: APPLIED in c.log.read_text())
    assert len(knit_routes(c)) == 2
    nat = in_ns(c.ns, "iptables-save", "-t", "nat")
    assert f"-j {EGRESS_CHAIN}" in nat and f"-j {PEER_CHAIN}" in nat
    eventually(
        what="c's policy table",
        check=lambda: f"table ip {POLICY_TABLE}" in in_ns(c.ns, "nft", "list", "tables"),
    )
    cluster.stop_daemon(c)
    try:
        in_ns(c.ns, sys.executable, "-m", "proxyd", "--cleanup", "--cluster-cidr", "10.0.0.0/8")
        assert knit_routes(c) == {} and knit_routes(c, 6) == {}
        assert VXLAN_DEVICE not in in_ns(c.ns, "ip", "link")
        nat = in_ns(c.ns, "iptables-save", "-t", "nat")
        assert EGRESS_CHAIN not in nat and PEER_CHAIN not in nat
        assert POLICY_TABLE not in in_ns(c.ns, "nft", "list", "tables")
    finally:
        cluster.start_daemon(c)
    eventually(what="c's routes back", check=lambda: len(knit_routes(c)) == 2)


def test_conflist_is_rewritten_only_when_it_changes(cluster: Cluster) -> None:
    b = cluster.nodes["b"]
    eventually(what="b's node networking", check=lambda: APPLIED in b.log.read_text())
    inode = b.conflist.stat().st_ino
    applied = b.log.read_text().count(APPLIED)
    cluster.stop_daemon(b)
    cluster.start_daemon(b)
    eventually(
        what="the restarted daemon's first apply",
        check=lambda: b.log.read_text().count(APPLIED) > applied,
    )
    assert b.conflist.stat().st_ino == inode
    cluster.stop_daemon(b)
    cluster.start_daemon(b, "--routing", "direct")
    eventually(what="a rewritten config", check=lambda: b.conflist.stat().st_ino != inode)
    assert json.loads(b.conflist.read_text())["plugins"][0]["mtu"] == 1500
    cluster.stop_daemon(b)
    cluster.start_daemon(b)
    eventually(
        what="the auto config back",
        check=lambda: json.loads(b.conflist.read_text())["plugins"][0]["mtu"] == 1450,
    )


def test_gc_after_a_reboot_releases_the_addresses_of_vanished_pods(cluster: Cluster) -> None:
    b = cluster.nodes["b"]
    survivor = cluster.add_pod(b, unique_name("survivor"))
    lost = cluster.add_pod(b, unique_name("lost"))
    store = b.data_dir / "knit"
    assert (store / lost.address()).exists()
    cluster.stop_daemon(b)
    # the reboot: the pod's namespace (and with it its veth) is gone, the dataDir is not
    cluster.vanish(lost)
    old = time.time() - 120
    for path in store.iterdir():
        os.utime(path, (old, old))
    # an ADD between reserving its address and creating its veth: young, so kept
    in_progress = store / str(ipaddress.ip_address(survivor.address()) + 200)
    in_progress.write_bytes(b"adding\r\neth0")
    cluster.start_daemon(b)
    assert not (store / lost.address()).exists()
    assert not (store / lost.address(6)).exists()
    assert (store / survivor.address()).exists() and (store / survivor.address(6)).exists()
    assert in_progress.read_bytes() == b"adding\r\neth0", "a reservation within the grace"
    in_progress.unlink()
