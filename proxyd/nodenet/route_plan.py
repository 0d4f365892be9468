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

Whoever may write one Node object must not steer this node's traffic, so a peer's claims are
checked first (check_peers) and plan_routes takes nothing else: a pod CIDR is routed only
inside the cluster CIDR, never as a /0, never over this node's own pod CIDR or networks, never
over an older node's; an InternalIP is a next hop or tunnel end only when it is unicast, not
this node's nor a pod's, and no older node holds it.
"""

from __future__ import annotations

import bisect
import hashlib
import ipaddress
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from cni import ip_text
from proxyd.model import InvalidObject, family_of

ROUTING_MODES = ("auto", "direct", "vxlan", "none")
VXLAN_OVERHEAD = {4: 50, 6: 70}


@dataclass(frozen=True)
class NodeNet:
    """What routing needs to know about one Node."""

    name: str
    pod_cidrs: tuple[str, ...]
    internal_ips: tuple[str, ...]
    created: datetime | None = None
    """metadata.creationTimestamp: of two Nodes claiming one CIDR or address, the older wins."""

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
class Refusal:
    """A pod CIDR or InternalIP a Node claims that this node will not act on."""

    node: str
    claim: str
    """What was refused, named: `pod CIDR 0.0.0.0/0`, `InternalIP 224.0.0.1`."""
    reason: str

    def __str__(self) -> str:
        return f"node {self.node}: {self.claim} refused: {self.reason}"


@dataclass(frozen=True)
class Peers:
    """The other nodes, each cut down to the pod CIDRs and InternalIPs it may claim, and the
    claims refused; made by check_peers, the only input plan_routes takes."""

    nodes: tuple[NodeNet, ...]
    refused: tuple[Refusal, ...]


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
        pod_cidrs = tuple(str(ip_text.network(c, strict=True)) for c in cidrs)
    except ValueError as err:
        raise InvalidObject(f"node {meta.get('name')}: bad podCIDRs {cidrs!r}") from err
    internal = []
    for entry in (obj.get("status") or {}).get("addresses") or []:
        if entry.get("type") == "InternalIP":
            try:
                internal.append(ip_text.address_text(entry.get("address")))
            except ValueError:
                continue
    return NodeNet(str(meta.get("name", "")), pod_cidrs, tuple(internal), _created(meta))


def _created(meta: dict[str, Any]) -> datetime | None:
    text = meta.get("creationTimestamp")
    if not text:
        return None
    try:
        created = datetime.fromisoformat(text)
    except (ValueError, TypeError) as err:
        raise InvalidObject(f"node {meta.get('name')}: bad creationTimestamp {text!r}") from err
    # The API server writes UTC with a Z; a time without a zone is taken as UTC too, so that
    # every pair of nodes can be compared.
    return created if created.tzinfo else created.replace(tzinfo=UTC)


def _age(node: NodeNet) -> tuple[bool, datetime, str]:
    """Oldest first, ties by name; a Node without a creationTimestamp counts as the newest."""
    return (node.created is None, node.created or datetime.min.replace(tzinfo=UTC), node.name)


class _Disjoint:
    """Networks that do not overlap one another, each with a label, sorted by family and start:
    the one a network overlaps is found by bisection, not by a walk (a cluster's thousands of
    nodes, an IPVS node's thousands of addresses)."""

    def __init__(self) -> None:
        self._starts: dict[int, list[int]] = {4: [], 6: []}
        self._entries: dict[int, list[tuple[ip_text.Network, str]]] = {4: [], 6: []}

    def add(self, network: ip_text.Network, label: str) -> None:
        starts = self._starts[network.version]
        at = bisect.bisect(starts, int(network.network_address))
        starts.insert(at, int(network.network_address))
        self._entries[network.version].insert(at, (network, label))

    def overlapping(self, network: ip_text.Network) -> tuple[ip_text.Network, str] | None:
        """The entry network overlaps, if any. Of the entries starting at or before network's
        last address, the last one reaches furthest, being disjoint from the others."""
        at = bisect.bisect(self._starts[network.version], int(network.broadcast_address))
        if at == 0:
            return None
        found, label = self._entries[network.version][at - 1]
        return (
            (found, label) if int(found.broadcast_address) >= int(network.network_address) else None
        )


def check_peers(
    local: NodeNet,
    nodes: Iterable[NodeNet],
    cluster_cidrs: Sequence[str],
    connected: Sequence[str],
) -> Peers:
    """Every other node with only the claims this node may act on, oldest first.

    cluster_cidrs: --cluster-cidr; a family without one admits no peer pod CIDR, since nothing
    else bounds what a Node may claim. connected: this node's interface addresses with their
    networks' prefix lengths (`10.77.1.11/24`), its underlay among them.
    """
    interfaces = [ipaddress.ip_interface(text) for text in connected]
    own_addresses = {str(interface.ip) for interface in interfaces} | set(local.internal_ips)
    broadcasts = {
        str(interface.network.broadcast_address)
        for interface in interfaces
        if interface.version == 4 and interface.network.prefixlen < 31
    }
    # Two sets, since this node's networks and pod CIDRs overlap (its bridge's address).
    own = (_Disjoint(), _Disjoint())
    for cidr in ip_text.collapsed(ipaddress.ip_network(text) for text in local.pod_cidrs):
        own[0].add(cidr, "this node's pod CIDR")
    for network in ip_text.collapsed(interface.network for interface in interfaces):
        own[1].add(network, "this node's network")
    clusters = [ipaddress.ip_network(cidr) for cidr in cluster_cidrs]
    others = sorted((node for node in nodes if node.name != local.name), key=_age)
    refused: list[Refusal] = []
    taken = _Disjoint()
    """Accepted pod CIDRs, each labelled with its node's name."""
    kept_cidrs: dict[str, tuple[str, ...]] = {}
    for node in others:
        kept: list[str] = []
        for text in node.pod_cidrs:
            cidr = ipaddress.ip_network(text)
            reason = _cidr_refusal(cidr, node.name, clusters, own, taken)
            if reason is None:
                kept.append(text)
                taken.add(cidr, node.name)
            else:
                refused.append(Refusal(node.name, f"pod CIDR {text}", reason))
        kept_cidrs[node.name] = tuple(kept)
    # Addresses are judged against every accepted pod CIDR, so only after all of them, and
    # against this node's own: an address there is a local pod's.
    holders: dict[str, str] = {}
    checked: list[NodeNet] = []
    for node in others:
        kept = []
        for text in node.internal_ips:
            if holders.get(text) == node.name:
                continue  # listed twice by the same node
            reason = _address_refusal(text, own_addresses, broadcasts, own[0], taken, holders)
            if reason is None:
                kept.append(text)
                holders[text] = node.name
            else:
                refused.append(Refusal(node.name, f"InternalIP {text}", reason))
        checked.append(replace(node, pod_cidrs=kept_cidrs[node.name], internal_ips=tuple(kept)))
    return Peers(tuple(checked), tuple(refused))


def _cidr_refusal(
    cidr: ip_text.Network,
    node: str,
    clusters: list[ip_text.Network],
    own: tuple[_Disjoint, _Disjoint],
    taken: _Disjoint,
) -> str | None:
    if cidr.prefixlen == 0:
        return "a /0 would take every destination"
    of_family = [cluster for cluster in clusters if cluster.version == cidr.version]
    if not of_family:
        return "no cluster CIDR of its family is configured"
    if not any(_subnet_of(cidr, cluster) for cluster in of_family):
        return "outside the cluster CIDR"
    for of_this_node in own:
        if mine := of_this_node.overlapping(cidr):
            network, what = mine
            return f"overlaps {what} {network}"
    if claimed := taken.overlapping(cidr):
        other, owner = claimed
        if owner == node:  # a Node listing two CIDRs that overlap
            return f"overlaps its own pod CIDR {other}"
        return f"overlaps {other} of the older node {owner}"
    return None


def _subnet_of(cidr: ip_text.Network, cluster: ip_text.Network) -> bool:
    if isinstance(cidr, ipaddress.IPv4Network) and isinstance(cluster, ipaddress.IPv4Network):
        return cidr.subnet_of(cluster)
    if isinstance(cidr, ipaddress.IPv6Network) and isinstance(cluster, ipaddress.IPv6Network):
        return cidr.subnet_of(cluster)
    return False


def _address_refusal(
    text: str,
    own_addresses: set[str],
    broadcasts: set[str],
    own_pods: _Disjoint,
    taken: _Disjoint,
    holders: dict[str, str],
) -> str | None:
    address = ipaddress.ip_address(text)
    if (
        address.is_loopback
        or address.is_multicast
        or address.is_unspecified
        or address.is_link_local
        or address.is_reserved  # IPv4's 240/4 with the broadcast address; IPv6's ::/8 and more
        or text in broadcasts
    ):
        return "not a unicast address"
    if text in own_addresses:
        return "an address of this node"
    if claimed := taken.overlapping(ipaddress.ip_network(text)):
        cidr, owner = claimed
        return f"inside pod CIDR {cidr} of node {owner}"
    if local := own_pods.overlapping(ipaddress.ip_network(text)):
        return f"inside {local[1]} {local[0]}"
    return f"held by the older node {holders[text]}" if text in holders else None


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
    peers: Peers,
    mode: str,
    on_link: Callable[[str], bool],
) -> RoutePlan:
    """Routes to the peers' accepted pod CIDRs; on_link(ip) says whether ip is a neighbour."""
    routes: list[PodRoute] = []
    overlay_peers: list[OverlayPeer] = []
    skipped: list[str] = []
    peer_vteps: list[PeerVtep] = []
    overlay_family = underlay_family(local)
    if mode == "none":
        return RoutePlan((), (), (), ())
    for node in sorted(peers.nodes, key=lambda n: n.name):
        if not node.pod_cidrs:
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
        overlay_peers.append(OverlayPeer(peer_underlay, vtep_mac(peer_underlay), vteps))
        node_address = node.address(4)
        if node_address is not None:
            peer_vteps += [
                PeerVtep(vtep_address(c), node_address) for c in overlay_cidrs if family_of(c) == 4
            ]
    return RoutePlan(tuple(routes), tuple(overlay_peers), tuple(skipped), tuple(peer_vteps))


def pod_mtu(uplink_mtu: int, mode: str, local: NodeNet) -> int:
    """The pods' MTU: the uplink's, less the VXLAN header when the overlay may carry them."""
    family = underlay_family(local)
    if mode in ("auto", "vxlan") and family is not None:
        return uplink_mtu - VXLAN_OVERHEAD[family]
    return uplink_mtu
