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
import socket
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from cni.kernel.addresses import link_addresses
from cni.kernel.families import ADDRESS_FAMILIES
from proxyd.addresses import link_index
from proxyd.model import family_of
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


def on_link(ipr: IPRoute, address: str) -> bool:
    """Whether the kernel reaches address without a gateway (same L2 segment)."""
    try:
        found = ipr.route("get", dst=address)
    except NetlinkError:
        return False
    return bool(found) and found[0].get("RTA_GATEWAY") is None


def connected_networks() -> tuple[str, ...]:
    """The node's interface addresses with their networks' prefix lengths (`10.77.1.11/24`)."""
    return tuple(f"{found.address}/{found.prefix_length}" for found in link_addresses())


def uplink_mtu(ipr: IPRoute, address: str) -> int:
    """The MTU of the link holding address (the node's InternalIP)."""
    for local in link_addresses(family_of(address)):
        if local.address == address:
            return int(ipr.get_links(local.link)[0].get("IFLA_MTU"))
    raise LookupError(f"no local interface holds {address}")


class RouteTable:
    def __init__(self, ipr: IPRoute, overlay: Overlay = Overlay()) -> None:
        self.ipr = ipr
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
        for address_family in ADDRESS_FAMILIES.values():
            for route in self.ipr.route("dump", family=address_family, table=MAIN_TABLE):
                if route.get("RTA_TABLE", route["table"]) != MAIN_TABLE:
                    continue
                dst = route.get("RTA_DST") or (
                    "::" if address_family == socket.AF_INET6 else "0.0.0.0"
                )
                cidr = str(ipaddress.ip_network(f"{dst}/{route['dst_len']}"))
                if route["proto"] == ROUTE_PROTOCOL:
                    knit[cidr] = KnitRoute(
                        route.get("RTA_GATEWAY") or "", route.get("RTA_OIF") or 0
                    )
                else:
                    others.add(cidr)
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
            spec: dict[str, object] = {"dst": route.cidr, "gateway": route.via}
            if route.overlay:
                spec.update(oif=overlay_index, flags=RTNH_F_ONLINK)
            try:
                self.ipr.route("add", proto=ROUTE_PROTOCOL, table=MAIN_TABLE, **spec)
            except NetlinkError as err:
                if err.code != errno.EEXIST:  # one made since the dump above
                    raise
                held.append((route.cidr, HELD))
                continue
            log.info("route to %s via %s%s", route.cidr, route.via, " (vxlan)" * route.overlay)
        return held

    def _delete(self, cidr: str, route: KnitRoute) -> None:
        """Deletes knit's route: the kernel matches the protocol, so no other route goes."""
        spec: dict[str, object] = {"oif": route.oif} if route.oif else {}
        if route.via:
            spec["gateway"] = route.via
        self.ipr.route("del", dst=cidr, proto=ROUTE_PROTOCOL, table=MAIN_TABLE, **spec)

    def _sync_device(self, local: NodeNet, plan: RoutePlan, mtu: int) -> int | None:
        if not plan.peers:
            self._delete_device()
            return None
        underlay = local.internal_ips[0]
        index = link_index(self.overlay.device)
        if index is None:
            self.ipr.link(
                "add",
                ifname=self.overlay.device,
                kind="vxlan",
                vxlan_id=self.overlay.vni,
                vxlan_port=self.overlay.port,
                vxlan_local=underlay,
                vxlan_learning=0,
                address=vtep_mac(underlay),
                mtu=mtu,
            )
            index = link_index(self.overlay.device)
            log.info("overlay device %s created (VNI %d)", self.overlay.device, self.overlay.vni)
        self.ipr.link("set", index=index, state="up", mtu=mtu)
        for cidr in local.pod_cidrs:
            if family_of(cidr) != 4:
                continue  # an IPv6 subnet's first address is its router anycast address
            try:
                self.ipr.addr("add", index=index, address=vtep_address(cidr), prefixlen=32)
            except NetlinkError as err:
                if err.code != errno.EEXIST:
                    raise
        return index

    def _delete_device(self) -> None:
        index = link_index(self.overlay.device)
        if index is not None:
            self.ipr.link("del", index=index)
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
        for entry in self.ipr.fdb("dump", ifindex=index):
            mac, dst = entry.get("NDA_LLADDR"), entry.get("NDA_DST")
            if not dst:
                continue
            # The kernel names a remote's port and VNI only where they differ from the device's.
            own = {"port": entry.get("NDA_PORT"), "vni": entry.get("NDA_VNI")}
            foreign = {key: value for key, value in own.items() if value is not None}
            if fdb.get(mac) != dst or foreign:
                self.ipr.fdb("del", ifindex=index, lladdr=mac, dst=dst, flags=NTF_SELF, **foreign)
            elif entry["state"] & NUD_PERMANENT:
                macs_in_place.add(mac)
        for address_family in ADDRESS_FAMILIES.values():
            for entry in self.ipr.neigh("dump", ifindex=index, family=address_family):
                dst, mac = entry.get("NDA_DST"), entry.get("NDA_LLADDR")
                permanent = entry["state"] & NUD_PERMANENT
                if not dst:
                    continue
                if dst in neighbours:  # a wrong one is replaced below
                    if neighbours[dst] == mac and permanent:
                        vteps_in_place.add(dst)
                elif permanent:  # a departed peer's, not one the kernel made (multicast)
                    self.ipr.neigh("del", ifindex=index, dst=dst, family=address_family)
        fdb = {mac: dst for mac, dst in fdb.items() if mac not in macs_in_place}
        neighbours = {vtep: mac for vtep, mac in neighbours.items() if vtep not in vteps_in_place}
        for mac, underlay in fdb.items():
            self.ipr.fdb(
                "replace",
                ifindex=index,
                lladdr=mac,
                dst=underlay,
                flags=NTF_SELF,
                state=NUD_PERMANENT,
            )
        for vtep, mac in neighbours.items():
            self.ipr.neigh(
                "replace",
                ifindex=index,
                dst=vtep,
                lladdr=mac,
                state=NUD_PERMANENT,
                family=ADDRESS_FAMILIES[family_of(vtep)],
            )
