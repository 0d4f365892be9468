"""The node routing's kernel side beyond the lab cluster (test_cluster.py): RouteTable, run in a
node namespace of its own, builds the VXLAN device with a forwarding and a neighbour entry per
peer across segments, drops a departed peer's entries and route, mends entries changed behind its
back (a forwarding entry to another address, one to another port, a neighbour entry
no longer permanent, its own route sent elsewhere) while an apply of the same peers again
writes no entry, and removes the device with the last such peer while a route to a peer on the
segment stays."""

from __future__ import annotations

import socket
from collections.abc import Callable

from cni.kernel.rawnetlink import NetlinkSocket
from deploy.lab.netns import Netns
from proxyd.nodenet import kernel
from proxyd.nodenet.route_plan import (
    NodeNet,
    Peers,
    check_peers,
    plan_routes,
    vtep_address,
    vtep_mac,
)
from proxyd.nodenet.routes import ROUTE_PROTOCOL, VXLAN_DEVICE, RouteTable

LOCAL = NodeNet("a", ("10.244.1.0/24",), ("10.77.1.11",))
NEIGHBOUR = NodeNet("b", ("10.244.2.0/24",), ("10.77.1.12",))
FAR = (
    NodeNet("c", ("10.244.3.0/24",), ("10.77.2.13",)),
    NodeNet("d", ("10.244.4.0/24",), ("10.77.3.14",)),
)


def checked(peers: list[NodeNet]) -> Peers:
    return check_peers(LOCAL, peers, ("10.244.0.0/16",), ("10.77.1.11/24",))


def on_segment(address: str) -> bool:
    return address.startswith("10.77.1.")


def apply(node: Netns, peers: list[NodeNet]) -> None:
    plan = plan_routes(LOCAL, checked(peers), "auto", on_segment)
    with node.entered(), kernel.route_socket() as sock:
        RouteTable(sock).apply(LOCAL, plan, 1450)


class EntryWritesCounted(NetlinkSocket):
    """A routing socket counting the forwarding and neighbour entries written or deleted
    through it."""

    def __init__(self) -> None:
        super().__init__(socket.NETLINK_ROUTE)
        self.writes = 0

    def request(self, kind: int, body: bytes, flags: int = 0) -> list[tuple[int, memoryview]]:
        self.writes += kind in (kernel.RTM_NEWNEIGH, kernel.RTM_DELNEIGH)
        return super().request(kind, body, flags)


def writes(node: Netns, peers: list[NodeNet]) -> int:
    """Forwarding and neighbour entries an apply of these peers writes or deletes."""
    plan = plan_routes(LOCAL, checked(peers), "auto", on_segment)
    with node.entered(), EntryWritesCounted() as counting:
        RouteTable(counting).apply(LOCAL, plan, 1450)
        return counting.writes


def test_the_overlay_device_goes_with_the_last_peer_across_segments(
    make_netns: Callable[[str], Netns],
) -> None:
    node = make_netns("overlay")
    node.ip("link", "add", "eth0", "type", "veth", "peer", "name", "segment")
    node.ip("link", "set", "segment", "up")
    node.ip("addr", "add", "10.77.1.11/24", "dev", "eth0")
    node.ip("link", "set", "eth0", "up")
    apply(node, [NEIGHBOUR, *FAR])
    assert f"{VXLAN_DEVICE}:" in node.ip("-o", "link", "show", "dev", VXLAN_DEVICE)
    forwarding = node.run("bridge", "fdb", "show", "dev", VXLAN_DEVICE).stdout
    for peer in FAR:
        underlay = peer.internal_ips[0]
        assert f"{vtep_mac(underlay)} dst {underlay}" in forwarding
        vtep = vtep_address(peer.pod_cidrs[0])
        assert vtep_mac(underlay) in node.ip("neigh", "show", vtep, "dev", VXLAN_DEVICE)
    routes = node.ip("route", "show", "proto", str(ROUTE_PROTOCOL))
    assert "10.244.2.0/24 via 10.77.1.12 dev eth0" in routes
    assert f"10.244.4.0/24 via {vtep_address('10.244.4.0/24')} dev {VXLAN_DEVICE}" in routes

    moved, cooled = FAR[0].internal_ips[0], FAR[1].internal_ips[0]
    vtep = vtep_address(FAR[1].pod_cidrs[0])
    node.run("bridge", "fdb", "replace", vtep_mac(moved), "dev", VXLAN_DEVICE, "dst", "10.77.9.9")
    node.ip(
        "neigh", "replace", vtep, "lladdr", vtep_mac(cooled), "dev", VXLAN_DEVICE, "nud", "stale"
    )
    mac = vtep_mac(cooled)
    node.run("bridge", "fdb", "replace", mac, "dev", VXLAN_DEVICE, "dst", cooled, "port", "4790")
    assert "port 4790" in node.run("bridge", "fdb", "show", "dev", VXLAN_DEVICE).stdout
    # Mended: the moved remote and the remote on another port (each deleted, then written
    # again), the stale neighbour (written); nothing else.
    assert writes(node, [NEIGHBOUR, *FAR]) == 5
    forwarding = node.run("bridge", "fdb", "show", "dev", VXLAN_DEVICE).stdout
    assert f"{vtep_mac(moved)} dst {moved}" in forwarding and "10.77.9.9" not in forwarding
    assert "PERMANENT" in node.ip("neigh", "show", vtep, "dev", VXLAN_DEVICE)
    assert f"{mac} dst {cooled} self permanent" in forwarding and "port 4790" not in forwarding
    assert writes(node, [NEIGHBOUR, *FAR]) == 0, "entries in place are left alone"
    node.ip("route", "replace", "10.244.2.0/24", "via", "10.77.1.99", "proto", str(ROUTE_PROTOCOL))
    apply(node, [NEIGHBOUR, *FAR])
    (mended,) = node.ip("route", "show", "10.244.2.0/24").splitlines()
    assert mended.startswith("10.244.2.0/24 via 10.77.1.12 dev eth0"), "knit's route is mended"

    apply(node, [NEIGHBOUR, FAR[0]])
    assert vtep_mac("10.77.3.14") not in node.run("bridge", "fdb", "show").stdout
    assert "10.244.4.0/24" not in node.ip("route", "show", "proto", str(ROUTE_PROTOCOL))
    assert not node.ip("neigh", "show", vtep_address("10.244.4.0/24"))

    apply(node, [NEIGHBOUR])
    assert VXLAN_DEVICE not in node.ip("link")
    (route,) = node.ip("route", "show", "proto", str(ROUTE_PROTOCOL)).splitlines()
    assert route.startswith("10.244.2.0/24 via 10.77.1.12 dev eth0"), "the segment's route stays"
