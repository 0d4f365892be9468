"""What a Node object may make this node do: each hostile claim (a /0, a CIDR outside the cluster
CIDR, on this node's own or underlay networks, or over another node's; an InternalIP that is
not unicast or is someone else's) is refused by the pure validation, named with its node and
reason, and the route plan neither routes nor tunnels to it."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxyd.model import InvalidObject
from proxyd.nodenet.manager import ReportedOnce
from proxyd.nodenet.route_plan import (
    NodeNet,
    PeerVtep,
    check_peers,
    parse_node_net,
    plan_routes,
)

CLUSTER = ("10.244.0.0/16", "fd10:244::/56")
CONNECTED = ("10.77.1.11/24", "127.0.0.1/8", "fd77:1::b/64", "::1/128", "fe80::1/64")
"""This node's interface addresses, each with its network's prefix length."""
NEIGHBOURS = {"10.77.1.12", "10.77.1.13", "10.77.1.14", "fd77:1::c", "fd77:1::d"}


def node(name: str, cidrs: tuple[str, ...], ips: tuple[str, ...], created: str) -> NodeNet:
    obj: dict[str, Any] = {
        "metadata": {"name": name, "creationTimestamp": created},
        "spec": {"podCIDRs": list(cidrs)},
        "status": {"addresses": [{"type": "InternalIP", "address": ip} for ip in ips]},
    }
    return parse_node_net(obj)


LOCAL = node(
    "a", ("10.244.1.0/24", "fd10:244:0:1::/64"), ("10.77.1.11", "fd77:1::b"), "2024-01-01T00:00:00Z"
)
GOOD = node(
    "b", ("10.244.2.0/24", "fd10:244:0:2::/64"), ("10.77.1.12", "fd77:1::c"), "2024-01-02T00:00:00Z"
)


def on_link(ip: str) -> bool:
    return ip in NEIGHBOURS


def routed(*nodes: NodeNet, mode: str = "auto", cluster: tuple[str, ...] = CLUSTER) -> set[str]:
    peers = check_peers(LOCAL, [LOCAL, *nodes], cluster, CONNECTED)
    return {route.cidr for route in plan_routes(LOCAL, peers, mode, on_link).routes}


def refusals(*nodes: NodeNet, cluster: tuple[str, ...] = CLUSTER) -> list[str]:
    return [str(r) for r in check_peers(LOCAL, [LOCAL, *nodes], cluster, CONNECTED).refused]


def test_a_good_peer_is_routed_on_both_families() -> None:
    assert routed(GOOD) == {"10.244.2.0/24", "fd10:244:0:2::/64"}
    assert refusals(GOOD) == []


def test_a_slash_zero_pod_cidr_is_refused_on_both_families() -> None:
    hostile = node("x", ("0.0.0.0/0", "::/0"), ("10.77.1.13", "fd77:1::d"), "2024-01-03T00:00:00Z")
    wide = ("0.0.0.0/0", "::/0")  # even a cluster CIDR covering everything admits no default route
    for cluster in (CLUSTER, wide):
        assert routed(GOOD, hostile, cluster=cluster) == {"10.244.2.0/24", "fd10:244:0:2::/64"}
    assert refusals(hostile) == [
        "node x: pod CIDR 0.0.0.0/0 refused: a /0 would take every destination",
        "node x: pod CIDR ::/0 refused: a /0 would take every destination",
    ]


def test_halves_of_the_default_route_and_other_outside_cidrs_are_refused() -> None:
    halves = node("x", ("0.0.0.0/1", "128.0.0.0/1"), ("10.77.1.13",), "2024-01-03T00:00:00Z")
    outside = node("y", ("10.245.0.0/24", "fd10:245::/64"), ("10.77.1.14",), "2024-01-03T00:00:00Z")
    straddling = node("z", ("10.244.0.0/15",), ("10.77.1.14",), "2024-01-03T00:00:00Z")
    assert routed(halves, outside, straddling) == set()
    assert "node y: pod CIDR 10.245.0.0/24 refused: outside the cluster CIDR" in refusals(outside)
    assert "node y: pod CIDR fd10:245::/64 refused: outside the cluster CIDR" in refusals(outside)


def test_without_a_cluster_cidr_of_its_family_no_peer_cidr_is_routed() -> None:
    assert routed(GOOD, cluster=("10.244.0.0/16",)) == {"10.244.2.0/24"}
    assert routed(GOOD, cluster=()) == set()
    assert refusals(GOOD, cluster=("10.244.0.0/16",)) == [
        "node b: pod CIDR fd10:244:0:2::/64 refused: no cluster CIDR of its family is configured"
    ]


def test_a_cidr_over_this_nodes_own_pod_cidr_is_refused() -> None:
    inside = node(
        "x", ("10.244.1.128/25", "fd10:244:0:1::/65"), ("10.77.1.13",), "2023-01-01T00:00:00Z"
    )
    around = node("y", ("10.244.0.0/23",), ("10.77.1.14",), "2023-01-01T00:00:00Z")
    assert routed(inside, around) == set(), "even from a Node older than this one"
    assert refusals(around) == [
        "node y: pod CIDR 10.244.0.0/23 refused: overlaps this node's pod CIDR 10.244.1.0/24"
    ]


def test_a_cidr_over_this_nodes_underlay_network_or_address_is_refused() -> None:
    wide = ("10.0.0.0/8", "fd00::/8")  # a cluster CIDR holding the underlay, so only this check
    subnet = node("x", ("10.77.1.0/24", "fd77:1::/64"), ("10.77.1.13",), "2024-01-03T00:00:00Z")
    host = node("y", ("10.77.1.11/32",), ("10.77.1.14",), "2024-01-03T00:00:00Z")
    assert routed(GOOD, subnet, host, cluster=wide) == {"10.244.2.0/24", "fd10:244:0:2::/64"}
    assert "node x: pod CIDR 10.77.1.0/24 refused: overlaps this node's network 10.77.1.0/24" in (
        refusals(subnet, cluster=wide)
    )
    assert "node x: pod CIDR fd77:1::/64 refused: overlaps this node's network fd77:1::/64" in (
        refusals(subnet, cluster=wide)
    )


def test_of_two_overlapping_peers_the_older_node_wins_whatever_the_names() -> None:
    newer = node(
        "a-newer", ("10.244.2.128/25", "fd10:244:0:2::/64"), ("10.77.1.13",), "2024-02-01T00:00:00Z"
    )
    assert routed(GOOD, newer) == {"10.244.2.0/24", "fd10:244:0:2::/64"}
    assert refusals(GOOD, newer) == [
        "node a-newer: pod CIDR 10.244.2.128/25 refused: overlaps 10.244.2.0/24 of the older "
        "node b",
        "node a-newer: pod CIDR fd10:244:0:2::/64 refused: overlaps fd10:244:0:2::/64 of the "
        "older node b",
    ]
    older = node("z-older", ("10.244.2.0/23",), ("10.77.1.13",), "2023-06-01T00:00:00Z")
    assert routed(GOOD, older) == {"10.244.2.0/23", "fd10:244:0:2::/64"}


def test_of_two_overlapping_peers_created_together_the_first_name_wins() -> None:
    twin = node("c", ("10.244.2.0/24",), ("10.77.1.13",), "2024-01-02T00:00:00Z")
    peers = check_peers(LOCAL, [twin, LOCAL, GOOD], CLUSTER, CONNECTED)
    assert [str(r) for r in peers.refused] == [
        "node c: pod CIDR 10.244.2.0/24 refused: overlaps 10.244.2.0/24 of the older node b"
    ]


def test_an_internal_ip_that_is_not_unicast_is_no_next_hop_and_no_tunnel_end() -> None:
    bad_ips = (
        ("127.0.0.1", "::1"),
        ("224.0.0.1", "ff02::1"),
        ("0.0.0.0", "::"),
        ("169.254.1.1", "fe80::2"),
        ("255.255.255.255", "fd77:1::d"),
        ("10.77.1.255", "fd77:1::d"),  # this node's underlay broadcast
    )
    for ipv4, ipv6 in bad_ips:
        hostile = node(
            "x", ("10.244.3.0/24", "fd10:244:0:3::/64"), (ipv4, ipv6), "2024-01-03T00:00:00Z"
        )
        for mode in ("auto", "direct", "vxlan"):
            peers = check_peers(LOCAL, [LOCAL, hostile], CLUSTER, CONNECTED)
            plan = plan_routes(LOCAL, peers, mode, lambda ip: True)
            assert plan.peers == () and "10.244.3.0/24" not in {r.cidr for r in plan.routes}, ipv4
        assert f"node x: InternalIP {ipv4} refused: not a unicast address" in refusals(hostile)
    loopback6 = node("y", ("fd10:244:0:3::/64",), ("::1",), "2024-01-03T00:00:00Z")
    assert routed(loopback6, mode="direct") == set()


def test_an_internal_ip_of_this_node_or_of_the_pod_network_is_refused() -> None:
    mine = node("x", ("10.244.3.0/24",), ("10.77.1.11",), "2024-01-03T00:00:00Z")
    pod = node("y", ("10.244.4.0/24",), ("10.244.2.7",), "2024-01-03T00:00:00Z")
    assert routed(GOOD, mine, pod, mode="direct") == {"10.244.2.0/24", "fd10:244:0:2::/64"}
    assert refusals(mine) == ["node x: InternalIP 10.77.1.11 refused: an address of this node"]
    assert refusals(GOOD, pod) == [
        "node y: InternalIP 10.244.2.7 refused: inside pod CIDR 10.244.2.0/24 of node b"
    ]


def test_an_internal_ip_another_node_holds_stays_with_the_older_node() -> None:
    far = node("c", ("10.244.3.0/24",), ("10.77.2.13",), "2024-01-02T00:00:00Z")
    thief = node("a-thief", ("10.244.4.0/24",), ("10.77.2.13", "fd77:1::c"), "2024-03-01T00:00:00Z")
    peers = check_peers(LOCAL, [LOCAL, GOOD, far, thief], CLUSTER, CONNECTED)
    plan = plan_routes(LOCAL, peers, "auto", on_link)
    assert [peer.vtep_addresses for peer in plan.peers] == [("10.244.3.0",)]
    assert {r.cidr for r in plan.routes} == {"10.244.2.0/24", "fd10:244:0:2::/64", "10.244.3.0/24"}
    assert plan.peer_vteps == (PeerVtep("10.244.3.0", "10.77.2.13"),), "no SNAT for the thief"
    assert [str(r) for r in peers.refused] == [
        "node a-thief: InternalIP 10.77.2.13 refused: held by the older node c",
        "node a-thief: InternalIP fd77:1::c refused: held by the older node b",
    ]


def test_refused_claims_leave_no_source_nat_for_the_peer() -> None:
    hostile = node("x", ("10.77.1.0/24",), ("224.0.0.1",), "2024-01-03T00:00:00Z")
    peers = check_peers(LOCAL, [LOCAL, hostile], CLUSTER, CONNECTED)
    assert plan_routes(LOCAL, peers, "vxlan", on_link).peer_vteps == ()
    assert peers.nodes == (NodeNet("x", (), (), hostile.created),)


def test_a_refusal_is_reported_once_while_it_lasts_and_again_when_it_returns() -> None:
    reports = ReportedOnce()
    assert reports.fresh(["x refused", "y refused"]) == ["x refused", "y refused"]
    assert reports.fresh(["y refused", "x refused"]) == []
    assert reports.fresh(["y refused"]) == []
    assert reports.fresh(["x refused", "y refused"]) == ["x refused"]


@given(st.lists(st.tuples(st.integers(0, 255), st.integers(16, 26)), max_size=40))
def test_the_accepted_cidrs_are_those_no_older_accepted_one_overlaps(
    claims: list[tuple[int, int]],
) -> None:
    nodes = [
        NodeNet(
            f"n{i:02}", (str(ipaddress.ip_network(f"10.245.{third}.0/{length}", strict=False)),), ()
        )
        for i, (third, length) in enumerate(claims)
    ]
    accepted: list[ipaddress.IPv4Network] = []
    for candidate in nodes:  # by name, as they have no creationTimestamp
        cidr = ipaddress.IPv4Network(candidate.pod_cidrs[0])
        if not any(cidr.overlaps(other) for other in accepted):
            accepted.append(cidr)
    peers = check_peers(LOCAL, nodes, ("10.245.0.0/16",), CONNECTED)
    assert [c for node in peers.nodes for c in node.pod_cidrs] == [str(c) for c in accepted]


def test_an_internal_ip_inside_this_nodes_own_pod_cidr_is_refused() -> None:
    """A peer claiming a local pod's address would be routed and tunnelled to that pod, and its
    overlay traffic given that pod's address as its source, which this node's policies trust."""
    squatter = node(
        "x", ("10.244.3.0/24",), ("10.244.1.5", "fd10:244:0:1::5"), "2024-01-03T00:00:00Z"
    )
    assert routed(GOOD, squatter) == {"10.244.2.0/24", "fd10:244:0:2::/64"}
    assert refusals(squatter) == [
        "node x: InternalIP 10.244.1.5 refused: inside this node's pod CIDR 10.244.1.0/24",
        "node x: InternalIP fd10:244:0:1::5 refused: inside this node's pod CIDR fd10:244:0:1::/64",
    ]
    plan = plan_routes(
        LOCAL, check_peers(LOCAL, [LOCAL, squatter], CLUSTER, CONNECTED), "auto", on_link
    )
    assert plan.peer_vteps == () and plan.peers == ()


def test_address_text_with_a_scope_id_is_no_claim_at_all() -> None:
    """A scope ID survives Python's ipaddress with any text after it, and pyroute2 refuses it:
    such a pod CIDR makes the Node unreadable, such an InternalIP is left out."""
    scoped = {
        "metadata": {"name": "x", "creationTimestamp": "2024-01-03T00:00:00Z"},
        "spec": {"podCIDRs": ["fd10:244:0:3::%x/64"]},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.77.1.13"}]},
    }
    with pytest.raises(InvalidObject):
        parse_node_net(scoped)
    scoped["spec"]["podCIDRs"] = ["10.244.3.0/24"]
    scoped["status"]["addresses"].insert(
        0, {"type": "InternalIP", "address": "2001:db8::5%a\nflush ruleset"}
    )
    assert parse_node_net(scoped).internal_ips == ("10.77.1.13",)
