"""Thin: puts a RoutePlan into the kernel through netlink, removing what it no longer holds.

Routes carry their own protocol number, so the ones of deleted nodes are found and removed
without any saved state; the overlay device is created when a peer needs it and removed
when none does. Only routes carrying that number are ever changed or deleted: a destination
another route of the main table already has (the operator's, a connected network's) is left
to it, and a new route is added, never written over one.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
from dataclasses import dataclass

from cni.kernel.addresses import link_addresses
from cni.kernel.families import ADDRESS_FAMILIES
from cni.kernel.rawnetlink import NetlinkSocket, RawNetlinkError
from cni.links import add_address, set_link
from cni.routes import table_routes
from proxyd.addresses import link_index
from proxyd.model import family_of
from proxyd.nodenet import kernel
from proxyd.nodenet.route_plan import (
    NodeNet,
    OverlayPeer,
    PodRoute,
    RoutePlan,
    vtep_address,
    vtep_mac,
)

log = logging.getLogger(__name__)

ROUTE_PROTOCOL = 107
"""rtm_protocol of knit's routes (unassigned in iproute2's rt_protos)."""
MAIN_TABLE = 254
HELD = "a route knit did not make holds it"
VXLAN_DEVICE = "knit.vxlan"
VXLAN_VNI = 1
VXLAN_PORT = 8472
NUD_PERMANENT = 0x80
NTF_SELF = 0x02
RTNH_F_ONLINK = 4
AF_BRIDGE = 7
"""The family of a link's forwarding entries."""


@dataclass(frozen=True)
class KnitRoute:
    """One of knit's routes as the kernel holds it."""

    via: str
    oif: int


@dataclass(frozen=True)
class Overlay:
    device: str = VXLAN_DEVICE
    vni: int = VXLAN_VNI
    port: int = VXLAN_PORT


def on_link(sock: NetlinkSocket, address: str) -> bool:
    """Whether the kernel reaches address without a gateway (same L2 segment)."""
    try:
        return not kernel.route_gateway(sock, address)
    except RawNetlinkError:
        return False


def connected_networks() -> tuple[str, ...]:
    """The node's interface addresses with their networks' prefix lengths (`10.77.1.11/24`)."""
    return tuple(f"{found.address}/{found.prefix_length}" for found in link_addresses())


def uplink_mtu(sock: NetlinkSocket, address: str) -> int:
    """The MTU of the link holding address (the node's InternalIP)."""
    for local in link_addresses(family_of(address)):
        if local.address == address:
            return kernel.link_mtu(sock, local.link)
    raise LookupError(f"no local interface holds {address}")


class RouteTable:
    def __init__(self, sock: NetlinkSocket, overlay: Overlay = Overlay()) -> None:
        self.sock = sock
        self.overlay = overlay

    def apply(self, local: NodeNet, plan: RoutePlan, mtu: int) -> list[tuple[str, str]]:
        """Puts the plan in place; returns the planned routes left out, with the reason."""
        overlay_index = self._sync_device(local, plan, mtu)
        if overlay_index is not None:
            self._sync_peers(overlay_index, plan.peers)
        return self._sync_routes(plan.routes, overlay_index)

    def remove_all(self) -> None:
        self._sync_routes((), None)
        self._delete_device()

    def main_table(self) -> tuple[dict[str, KnitRoute], set[str]]:
        """The main table's routes: knit's by destination, and the others' destinations."""
        knit: dict[str, KnitRoute] = {}
        others: set[str] = set()
        for route in table_routes(self.sock, MAIN_TABLE):
            if route.protocol == ROUTE_PROTOCOL:
                knit[str(route.dst)] = KnitRoute(route.gateway or "", route.oif)
            else:
                others.add(str(route.dst))
        return knit, others

    def _sync_routes(
        self, routes: tuple[PodRoute, ...], overlay_index: int | None
    ) -> list[tuple[str, str]]:
        knit, others = self.main_table()
        held = [(route.cidr, HELD) for route in routes if route.cidr in others]
        wanted = [route for route in routes if route.cidr not in others]
        for cidr in set(knit) - {route.cidr for route in wanted}:
            self._delete(cidr, knit[cidr])
            log.info("route to %s removed", cidr)
        for route in wanted:
            have = knit.get(route.cidr)
            overlay_oif = overlay_index if route.overlay else None
            if have is not None and have.via == route.via and overlay_oif in (None, have.oif):
                continue
            if have is not None:
                # Deleted and added again rather than replaced: a replace would take whatever
                # route holds the destination's slot, and a route is only ever knit's to delete.
                self._delete(route.cidr, have)
            try:
                kernel.add_route(
                    self.sock,
                    route.cidr,
                    route.via,
                    ROUTE_PROTOCOL,
                    MAIN_TABLE,
                    oif=overlay_oif or 0,
                    flags=RTNH_F_ONLINK if route.overlay else 0,
                )
            except RawNetlinkError as err:
                if err.errno != errno.EEXIST:  # one made since the dump above
                    raise
                held.append((route.cidr, HELD))
                continue
            log.info("route to %s via %s%s", route.cidr, route.via, " (vxlan)" * route.overlay)
        return held

    def _delete(self, cidr: str, route: KnitRoute) -> None:
        """Deletes knit's route: the kernel matches the protocol, so no other route goes."""
        try:
            kernel.delete_route(self.sock, cidr, route.via, ROUTE_PROTOCOL, MAIN_TABLE, route.oif)
        except RawNetlinkError as err:
            if err.errno != errno.ESRCH:  # gone since the dump: what was wanted
                raise

    def _sync_device(self, local: NodeNet, plan: RoutePlan, mtu: int) -> int | None:
        if not plan.peers:
            self._delete_device()
            return None
        underlay = local.internal_ips[0]
        index = link_index(self.overlay.device)
        if index is None:
            overlay = self.overlay
            kernel.create_vxlan(
                self.sock, overlay.device, overlay.vni, overlay.port, underlay,
                vtep_mac(underlay), mtu,
            )  # fmt: skip
            index = link_index(overlay.device)
            if index is None:
                raise LookupError(f"overlay device {overlay.device} vanished once made")
            log.info("overlay device %s created (VNI %d)", overlay.device, overlay.vni)
        set_link(index, up=True, mtu=mtu)
        for cidr in local.pod_cidrs:
            if family_of(cidr) != 4:
                continue  # an IPv6 subnet's first address is its router anycast address
            try:
                add_address(index, ipaddress.ip_interface(f"{vtep_address(cidr)}/32"))
            except RawNetlinkError as err:
                if err.errno != errno.EEXIST:
                    raise
        return index

    def _delete_device(self) -> None:
        index = link_index(self.overlay.device)
        if index is not None:
            kernel.delete_link(self.sock, index)
            log.info("overlay device %s removed", self.overlay.device)

    def _sync_peers(self, index: int, peers: tuple[OverlayPeer, ...]) -> None:
        """A permanent forwarding entry (peer MAC -> underlay address) and neighbour entry (VTEP
        address -> peer MAC) per peer: others removed (but the neighbour entries the kernel
        makes itself, such as IPv6 multicast ones), missing or different ones written, the
        rest left alone."""
        fdb = {peer.mac: peer.underlay_ip for peer in peers}
        neighbours = {vtep: peer.mac for peer in peers for vtep in peer.vtep_addresses}
        macs_in_place: set[str] = set()
        vteps_in_place: set[str] = set()
        for entry in kernel.neighbours(self.sock, index, AF_BRIDGE):
            if not entry.dst:
                continue
            # The kernel names a remote's port and VNI only where they differ from the device's.
            foreign = entry.port is not None or entry.vni is not None
            if fdb.get(entry.mac) != entry.dst or foreign:
                try:
                    kernel.delete_neighbour(
                        self.sock, AF_BRIDGE, index, entry.dst, entry.mac, NTF_SELF, entry.port,
                        entry.vni,
                    )  # fmt: skip
                except RawNetlinkError as err:
                    # an entry this request cannot name (another source VNI or device) stays:
                    # the peers' entries are still written below
                    if err.errno != errno.ENOENT:
                        raise
            elif entry.state & NUD_PERMANENT:
                macs_in_place.add(entry.mac)
        for address_family in ADDRESS_FAMILIES.values():
            for entry in kernel.neighbours(self.sock, index, address_family):
                permanent = entry.state & NUD_PERMANENT
                if not entry.dst:
                    continue
                if entry.dst in neighbours:  # a wrong one is replaced below
                    if neighbours[entry.dst] == entry.mac and permanent:
                        vteps_in_place.add(entry.dst)
                elif permanent:  # a departed peer's, not one the kernel made (multicast)
                    kernel.delete_neighbour(self.sock, address_family, index, entry.dst)
        fdb = {mac: dst for mac, dst in fdb.items() if mac not in macs_in_place}
        neighbours = {vtep: mac for vtep, mac in neighbours.items() if vtep not in vteps_in_place}
        for mac, underlay in fdb.items():
            kernel.write_neighbour(
                self.sock, AF_BRIDGE, index, underlay, mac, NUD_PERMANENT, NTF_SELF
            )
        for vtep, mac in neighbours.items():
            family = ADDRESS_FAMILIES[family_of(vtep)]
            kernel.write_neighbour(self.sock, family, index, vtep, mac, NUD_PERMANENT)
