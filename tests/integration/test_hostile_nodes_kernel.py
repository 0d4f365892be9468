"""Node objects that try to steer a node's traffic, against the node daemon's networking in a
node namespace of its own: a podCIDR of 0.0.0.0/0 and ::/0, one equal to the underlay subnet,
one over a good peer's, one where the operator has a route of their own, InternalIPs that are
multicast or another node's. The node's own routes stay as they were, its egress exemption
and peers' source NAT are not widened, and the good peers still get their routes; deleting the
hostile Nodes or cleaning up leaves the operator's route."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deploy.lab.netns import Netns
from proxyd.iptables.kernel import IptablesKernel
from proxyd.nodenet import kernel
from proxyd.nodenet.manager import NodeNetwork, NodeNetworkOptions
from proxyd.nodenet.routes import ROUTE_PROTOCOL, VXLAN_DEVICE, RouteTable
from proxyd.nodenet.source_nat import EGRESS_CHAIN, PEER_CHAIN

CLUSTER = ("10.0.0.0/8", "fd00::/8")
"""Wide enough to hold the underlay: only the check of the node's own networks refuses it."""
OPERATORS_ROUTE = "10.244.7.0/24 via 10.77.1.50 dev eth0 metric 100"


def node_object(name: str, created: str, cidrs: list[str], ips: list[str]) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "creationTimestamp": created},
        "spec": {"podCIDRs": cidrs},
        "status": {"addresses": [{"type": "InternalIP", "address": ip} for ip in ips]},
    }


LOCAL = node_object(
    "a", "2024-01-01T00:00:00Z", ["10.244.1.0/24", "fd10:244:0:1::/64"], ["10.77.1.11", "fd77:1::b"]
)
GOOD = [
    node_object(
        "b",
        "2024-01-02T00:00:00Z",
        ["10.244.2.0/24", "fd10:244:0:2::/64"],
        ["10.77.1.12", "fd77:1::c"],
    ),
    node_object("c", "2024-01-02T00:00:00Z", ["10.244.3.0/24"], ["10.77.2.13"]),  # over VXLAN
]
HOSTILE = [
    node_object("default", "2024-02-01T00:00:00Z", ["0.0.0.0/0", "::/0"], ["10.77.1.21"]),
    node_object(
        "underlay", "2024-02-01T00:00:00Z", ["10.77.1.0/24", "fd77:1::/64"], ["10.77.1.22"]
    ),
    node_object("half-of-b", "2024-02-01T00:00:00Z", ["10.244.2.128/25"], ["10.77.1.23"]),
    node_object("operators", "2024-02-01T00:00:00Z", ["10.244.7.0/24"], ["10.77.1.24"]),
    node_object("b-twin", "2024-02-01T00:00:00Z", ["10.244.8.0/24"], ["10.77.1.12"]),
    node_object("multicast", "2024-02-01T00:00:00Z", ["10.244.9.0/24"], ["224.0.0.5"]),
]
KNIT_ROUTES = {
    "10.244.2.0/24 via 10.77.1.12 dev eth0",
    "fd10:244:0:2::/64 via fd77:1::c dev eth0",
    f"10.244.3.0/24 via 10.244.3.0 dev {VXLAN_DEVICE} onlink",
}


def routes(node: Netns) -> tuple[set[str], set[str]]:
    """The main table's routes of both families: knit's (without their protocol and metric
    words), and the others as ip prints them but those of knit's VXLAN device, which come and
    go with it (its IPv6 link-local network)."""
    knit: set[str] = set()
    others: set[str] = set()
    for family in ("-4", "-6"):
        for line in node.ip(family, "route", "show", "table", "main").splitlines():
            if f"proto {ROUTE_PROTOCOL}" in line:
                words = line.split()
                cut = [
                    w
                    for i, w in enumerate(words)
                    if not {w, words[i - 1]} & {"proto", "metric", "pref"}
                ]
                knit.add(" ".join(cut))
            elif f"dev {VXLAN_DEVICE}" not in line:
                others.add(line.strip())
    return knit, others


@pytest.fixture
def node(make_netns: Callable[[str], Netns]) -> Netns:
    node = make_netns("hostile")
    node.ip("link", "set", "lo", "up")
    node.ip("link", "add", "eth0", "type", "veth", "peer", "name", "segment")
    node.ip("link", "set", "segment", "up")
    node.ip("addr", "add", "10.77.1.11/24", "dev", "eth0")
    node.ip("addr", "add", "fd77:1::b/64", "dev", "eth0", "nodad")
    node.ip("link", "set", "eth0", "up")
    node.ip("route", "add", "default", "via", "10.77.1.1", "dev", "eth0")
    node.ip("-6", "route", "add", "default", "via", "fd77:1::1", "dev", "eth0")
    node.ip("route", "add", *OPERATORS_ROUTE.split())
    return node


def test_hostile_nodes_leave_the_nodes_routes_and_a_good_peer_is_routed(
    node: Netns, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _, before = routes(node)
    assert OPERATORS_ROUTE in before and any(r.startswith("default") for r in before)
    options = NodeNetworkOptions("a", "auto", tmp_path, str(tmp_path / "data"), CLUSTER)
    with node.entered():
        network = NodeNetwork(options, [IptablesKernel(4)])
    network.replace([LOCAL, *GOOD, *HOSTILE])
    caplog.set_level(logging.WARNING, logger="proxyd.nodenet.manager")
    with node.entered():
        network.apply()
    knit, others = routes(node)
    assert others == before, "no route knit did not make was replaced or removed"
    assert knit == KNIT_ROUTES, "the good peers routed, directly and over VXLAN; no hostile one"
    warned = "\n".join(caplog.messages)
    for refused in (
        "node default: pod CIDR 0.0.0.0/0 refused",
        "node default: pod CIDR ::/0 refused",
        "node underlay: pod CIDR 10.77.1.0/24 refused: overlaps this node's network 10.77.1.0/24",
        "node half-of-b: pod CIDR 10.244.2.128/25 refused: overlaps 10.244.2.0/24 of the older",
        "node b-twin: InternalIP 10.77.1.12 refused: held by the older node b",
        "node multicast: InternalIP 224.0.0.5 refused: not a unicast address",
        "route to 10.244.7.0/24 not added: a route knit did not make holds it",
    ):
        assert refused in warned

    nat = node.run("iptables-save", "-t", "nat").stdout.splitlines()
    assert [line for line in nat if line.startswith(f"-A {EGRESS_CHAIN}")] == [
        f"-A {EGRESS_CHAIN} -s 10.244.1.0/24 -d 10.0.0.0/8 -j RETURN",
        f"-A {EGRESS_CHAIN} -s 10.244.1.0/24 -j MASQUERADE --random-fully",
    ], "no hostile CIDR (0.0.0.0/0 above all) is exempt from masquerade"
    assert [line for line in nat if line.startswith(f"-A {PEER_CHAIN}")] == [
        f"-A {PEER_CHAIN} -s 10.244.3.0/32 -j SNAT --to-source 10.77.2.13"
    ]

    caplog.clear()
    with node.entered():
        network.apply()
    assert not caplog.messages, "a refusal is logged when it shows, not at every apply"
    assert routes(node) == (KNIT_ROUTES, before)

    for obj in HOSTILE:
        network.event("DELETED", obj)
    with node.entered():
        network.apply()
        with kernel.route_socket() as sock:
            RouteTable(sock).remove_all()
    assert routes(node) == (set(), before), "cleanup takes knit's routes and only those"
