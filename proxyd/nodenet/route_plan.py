"""Pure: Node objects -> the routes to other nodes' pod CIDRs and the overlay's entries.

Direct routing sends a peer's pod CIDR via the peer's InternalIP, which works when both nodes
share an L2 segment (as on kind). Otherwise the packets go over VXLAN: the route points at
the peer's VTEP address (the first address of its pod CIDR, marked on-link) on the overlay
device, a permanent neighbour entry maps that address to the peer's VTEP MAC, and a
forwarding entry maps the MAC to the peer's underlay address. VTEP MACs are derived from the
node's underlay address, so no node needs to publish anything.

A node's own traffic into the overlay leaves from its IPv4 VTEP address (the only address its
VXLAN device holds, so masquerading picks it too), which keeps replies on the overlay; the
receiving node gives such traffic the sender's InternalIP (see source_nat.py), so pods see a
peer's traffic come from its node address, as over direct routes.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxyd.model import InvalidObject, family_of

ROUTING_MODES = ("auto", "direct", "vxlan", "none")
VXLAN_OVERHEAD = {4: 50, 6: 70}


@dataclass(frozen=True)
class NodeNet:
    """What routing needs to know about one Node."""

    name: str
    pod_cidrs: tuple[str, ...]
    internal_ips: tuple[str, ...]

    def address(self, family: int) -> str | None:
        return next((ip for ip in self.internal_ips if family_of(ip) == family), None)


@dataclass(frozen=True)
class PodRoute:
    cidr: str
    via: str
    overlay: bool


@dataclass(frozen=True)
class OverlayPeer:
    """The forwarding and neighbour entries that make a peer's VTEP reachable."""

    underlay_ip: str
    mac: str
    vtep_addresses: tuple[str, ...]


@dataclass(frozen=True)
class PeerVtep:
    """A peer's IPv4 VTEP address, which its own traffic into the overlay comes from, and the
    peer's InternalIP that such traffic is given on arrival."""

    vtep: str
    node_address: str


@dataclass(frozen=True)
class RoutePlan:
    routes: tuple[PodRoute, ...]
    peers: tuple[OverlayPeer, ...]
    skipped: tuple[str, ...]
    """Peers' pod CIDRs that cannot be routed in this mode, with the reason."""
    peer_vteps: tuple[PeerVtep, ...]


def parse_node_net(obj: dict[str, Any]) -> NodeNet:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    cidrs = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    try:
        pod_cidrs = tuple(str(ipaddress.ip_network(c)) for c in cidrs)
    except (ValueError, TypeError) as err:
        raise InvalidObject(f"node {meta.get('name')}: bad podCIDRs {cidrs!r}") from err
    internal = []
    for entry in (obj.get("status") or {}).get("addresses") or []:
        if entry.get("type") == "InternalIP":
            try:
                internal.append(str(ipaddress.ip_address(entry.get("address"))))
            except ValueError:
                continue
    return NodeNet(str(meta.get("name", "")), pod_cidrs, tuple(internal))


def vtep_mac(underlay_ip: str) -> str:
    """A locally administered unicast MAC derived from the node's underlay address."""
    digest = hashlib.sha256(ipaddress.ip_address(underlay_ip).packed).digest()
    return ":".join(f"{b:02x}" for b in (0x0E, 0x6B, *digest[:4]))


def vtep_address(cidr: str) -> str:
    return str(ipaddress.ip_network(cidr).network_address)


def underlay_family(local: NodeNet) -> int | None:
    return family_of(local.internal_ips[0]) if local.internal_ips else None


def plan_routes(
    local: NodeNet,
    nodes: list[NodeNet],
    mode: str,
    on_link: Callable[[str], bool],
) -> RoutePlan:
    """Routes to every other node's pod CIDRs; on_link(ip) says whether ip is a neighbour."""
    routes: list[PodRoute] = []
    peers: list[OverlayPeer] = []
    skipped: list[str] = []
    peer_vteps: list[PeerVtep] = []
    overlay_family = underlay_family(local)
    if mode == "none":
        return RoutePlan((), (), (), ())
    for node in sorted(nodes, key=lambda n: n.name):
        if node.name == local.name or not node.pod_cidrs:
            continue
        overlay_cidrs: list[str] = []
        for cidr in node.pod_cidrs:
            gateway = node.address(family_of(cidr))
            direct = gateway is not None and (mode == "direct" or on_link(gateway))
            if mode != "vxlan" and direct and gateway is not None:
                routes.append(PodRoute(cidr, gateway, overlay=False))
            elif mode == "direct":
                skipped.append(f"{cidr} of {node.name}: no InternalIP of its family")
            else:
                overlay_cidrs.append(cidr)
        if not overlay_cidrs:
            continue
        peer_underlay = node.address(overlay_family) if overlay_family else None
        if peer_underlay is None:
            skipped += [f"{c} of {node.name}: no InternalIP to tunnel to" for c in overlay_cidrs]
            continue
        vteps = tuple(vtep_address(c) for c in overlay_cidrs)
        routes += [PodRoute(c, v, overlay=True) for c, v in zip(overlay_cidrs, vteps, strict=True)]
        peers.append(OverlayPeer(peer_underlay, vtep_mac(peer_underlay), vteps))
        node_address = node.address(4)
        if node_address is not None:
            peer_vteps += [
                PeerVtep(vtep_address(c), node_address) for c in overlay_cidrs if family_of(c) == 4
            ]
    return RoutePlan(tuple(routes), tuple(peers), tuple(skipped), tuple(peer_vteps))


def pod_mtu(uplink_mtu: int, mode: str, local: NodeNet) -> int:
    """The pods' MTU: the uplink's, less the VXLAN header when the overlay may carry them."""
    family = underlay_family(local)
    if mode in ("auto", "vxlan") and family is not None:
        return uplink_mtu - VXLAN_OVERHEAD[family]
    return uplink_mtu
