"""Node networking's pure parts: route plans, the conflist, the source NAT chains."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxyd.model import InvalidObject
from proxyd.nodenet import conflist
from proxyd.nodenet.manager import NodeNetwork, NodeNetworkOptions
from proxyd.nodenet.route_plan import (
    NodeNet,
    Peers,
    PeerVtep,
    check_peers,
    parse_node_net,
    plan_routes,
    pod_mtu,
    vtep_mac,
)
from proxyd.nodenet.source_nat import (
    EGRESS_CHAIN,
    HOOKS,
    PEER_CHAIN,
    render,
    render_peers,
    restore_script,
)

A = NodeNet("a", ("10.244.1.0/24", "fd10:244:0:1::/64"), ("10.77.1.11", "fd77:1::b"))
B = NodeNet("b", ("10.244.2.0/24", "fd10:244:0:2::/64"), ("10.77.1.12", "fd77:1::c"))
C = NodeNet("c", ("10.244.3.0/24",), ("10.77.2.13",))
NEIGHBOURS = {"10.77.1.12", "fd77:1::c"}
CLUSTER = ("10.244.0.0/16", "fd10:244::/56")


def peers(*nodes: NodeNet) -> Peers:
    """The nodes as a's routing accepts them (its underlay 10.77.1.0/24)."""
    return check_peers(A, nodes, CLUSTER, ("10.77.1.11/24", "fd77:1::b/64"))


def on_link(ip: str) -> bool:
    return ip in NEIGHBOURS


def test_auto_routes_neighbours_directly_and_the_rest_over_vxlan() -> None:
    plan = plan_routes(A, peers(A, B, C), "auto", on_link)
    routes = {(r.cidr, r.via, r.overlay) for r in plan.routes}
    assert routes == {
        ("10.244.2.0/24", "10.77.1.12", False),
        ("fd10:244:0:2::/64", "fd77:1::c", False),
        ("10.244.3.0/24", "10.244.3.0", True),
    }
    (peer,) = plan.peers
    assert (peer.underlay_ip, peer.mac, peer.vtep_addresses) == (
        "10.77.2.13",
        vtep_mac("10.77.2.13"),
        ("10.244.3.0",),
    )


def test_vxlan_mode_tunnels_every_peer_and_carries_ipv6_over_the_ipv4_underlay() -> None:
    plan = plan_routes(A, peers(A, B), "vxlan", on_link)
    assert {(r.cidr, r.via) for r in plan.routes} == {
        ("10.244.2.0/24", "10.244.2.0"),
        ("fd10:244:0:2::/64", "fd10:244:0:2::"),
    }
    assert all(r.overlay for r in plan.routes) and plan.peers[0].underlay_ip == "10.77.1.12"


def test_direct_mode_skips_what_it_cannot_route_and_none_routes_nothing() -> None:
    lonely = NodeNet("d", ("fd10:244:0:4::/64",), ("10.77.1.14",))
    plan = plan_routes(A, peers(A, lonely), "direct", on_link)
    assert plan.routes == () and "no InternalIP of its family" in plan.skipped[0]
    assert plan_routes(A, peers(A, B, C), "none", on_link).routes == ()


def test_nodes_without_a_pod_cidr_get_no_route_and_macs_are_stable_and_local() -> None:
    assert plan_routes(A, peers(NodeNet("e", (), ("10.77.1.15",))), "auto", on_link).routes == ()
    mac = vtep_mac("10.77.2.13")
    assert mac == vtep_mac("10.77.2.13") != vtep_mac("10.77.2.14")
    assert int(mac[:2], 16) & 0b11 == 0b10  # locally administered, unicast


def test_pod_mtu_leaves_room_for_vxlan_only_when_the_overlay_may_be_used() -> None:
    assert pod_mtu(1500, "auto", A) == 1450
    assert pod_mtu(1500, "vxlan", NodeNet("v6", (), ("fd77::1",))) == 1430
    assert pod_mtu(1500, "direct", A) == 1500


def test_parse_node_reads_pod_cidrs_and_internal_ips_and_refuses_bad_cidrs() -> None:
    obj = {
        "metadata": {"name": "a"},
        "spec": {"podCIDR": "10.244.1.0/24"},
        "status": {
            "addresses": [
                {"type": "Hostname", "address": "a"},
                {"type": "InternalIP", "address": "10.77.1.11"},
            ]
        },
    }
    assert parse_node_net(obj) == NodeNet("a", ("10.244.1.0/24",), ("10.77.1.11",))
    with pytest.raises(InvalidObject):
        parse_node_net({"metadata": {"name": "x"}, "spec": {"podCIDRs": ["10.244.1.1/24"]}})


def test_conflist_version_suits_runtimes_with_and_without_negotiation() -> None:
    conf = conflist.render(A.pod_cidrs, "/var/lib/cni/networks", 1450)
    # libcni before 1.2 (containerd 1.6/1.7) reads cniVersion alone and knows 1.0.0 at most;
    # libcni 1.2+ picks the newest of cniVersions it supports.
    assert conf["cniVersion"] == "1.0.0"
    assert conf["cniVersions"] == ["1.0.0", "1.1.0"]


def test_conflist_is_written_by_rename_and_only_when_it_changes(tmp_path: Path) -> None:
    conf = conflist.render(A.pod_cidrs, "/var/lib/cni/networks", 1450)
    assert conflist.write_if_changed(tmp_path, conf)
    path = tmp_path / conflist.CONFLIST_NAME
    inode = path.stat().st_ino
    assert not conflist.write_if_changed(tmp_path, conf)
    assert path.stat().st_ino == inode
    assert conflist.write_if_changed(tmp_path, conflist.render(A.pod_cidrs, "/data", 1450))
    assert path.stat().st_ino != inode and [p.name for p in tmp_path.iterdir()] == [path.name]
    plugin = conflist.read(tmp_path)
    assert plugin is not None and plugin["name"] == "knit" and plugin["ipam"]["dataDir"] == "/data"
    assert json.loads(path.read_text())["plugins"][1]["type"] == "portmap"


def test_egress_masquerades_what_leaves_the_cluster_cidrs() -> None:
    cluster = ("10.244.0.0/16", "fd10:244::/56", "10.244.2.0/24", "10.245.1.0/24", "10.245.0.0/24")
    rules = render(4, A.pod_cidrs, cluster)
    assert rules == [
        f"-A {EGRESS_CHAIN} -s 10.244.1.0/24 -d 10.244.0.0/16 -j RETURN",
        f"-A {EGRESS_CHAIN} -s 10.244.1.0/24 -d 10.245.0.0/23 -j RETURN",
        f"-A {EGRESS_CHAIN} -s 10.244.1.0/24 -j MASQUERADE --random-fully",
    ], "a node's pod CIDR inside the cluster CIDR adds no rule; adjacent ones merge"
    assert render(6, ("10.244.1.0/24",), ()) == []
    assert all(hook in restore_script(rules, []) for hook in HOOKS)
    assert "POSTROUTING" not in restore_script(rules, list(HOOKS))


def test_a_peers_traffic_over_vxlan_is_given_the_peers_node_address() -> None:
    dual = NodeNet("d", ("10.244.4.0/24", "fd10:244:0:4::/64"), ("10.77.3.14", "fd77:3::e"))
    plan = plan_routes(A, peers(A, B, C, dual), "auto", on_link)
    assert plan.peer_vteps == (
        PeerVtep("10.244.3.0", "10.77.2.13"),
        PeerVtep("10.244.4.0", "10.77.3.14"),
    ), "only IPv4 VTEP addresses are ever a source, and b is routed directly"
    assert render_peers(4, plan.peer_vteps) == [
        f"-A {PEER_CHAIN} -s 10.244.3.0 -j SNAT --to-source 10.77.2.13",
        f"-A {PEER_CHAIN} -s 10.244.4.0 -j SNAT --to-source 10.77.3.14",
    ]
    assert render_peers(6, plan.peer_vteps) == []
    ipv6_only = NodeNet("e", ("10.244.5.0/24",), ("fd77:3::f",))
    assert plan_routes(A, peers(A, ipv6_only), "vxlan", on_link).peer_vteps == ()


def test_node_updates_that_change_nothing_routing_uses_do_not_wake_the_worker() -> None:
    network = NodeNetwork(NodeNetworkOptions("a", "auto", Path("/nonexistent"), "/d", ()), [])
    obj = {
        "metadata": {"name": "b", "resourceVersion": "1"},
        "spec": {"podCIDRs": ["10.244.2.0/24"]},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.77.1.12"}]},
    }
    network.replace([obj])
    assert network.changed.is_set()
    network.changed.clear()
    network.event("MODIFIED", {**obj, "metadata": {"name": "b", "resourceVersion": "2"}})
    network.replace([obj])
    assert not network.changed.is_set()
    network.event("DELETED", obj)
    assert network.changed.is_set() and network.nodes == {}
