"""A pod's routes through rawnetlink: add one (with the CNI 1.1 extras: priority, table,
scope, mtu, advmss) and list a link's in one table, for CHECK. Each works in the calling
thread's network namespace."""

from __future__ import annotations

import _socket  # not socket: see cni.kernel.rawnetlink
import ipaddress
import struct

from cni.kernel.families import ADDRESS_FAMILIES
from cni.kernel.rawnetlink import CREATE_NEW, U32, NetlinkSocket, attribute, attributes, request
from cni.record import Record
from cni.result import IPNetwork, Route

RTM_NEWROUTE, RTM_GETROUTE = 24, 26
RTMSG = struct.Struct("=BBBBBBBBI")
"""rtmsg: family, destination and source prefix lengths, TOS, table, protocol, scope, type,
flags."""
RTA_DST, RTA_OIF, RTA_GATEWAY, RTA_PRIORITY, RTA_METRICS, RTA_TABLE = 1, 4, 5, 6, 8, 15
RTAX_MTU, RTAX_ADVMSS = 2, 8
METRICS = {"mtu": RTAX_MTU, "advmss": RTAX_ADVMSS}
MAIN_TABLE = 254
RT_TABLE_COMPAT = 252
"""rtmsg's table field for tables above 255, which only RTA_TABLE can name."""
RTPROT_STATIC, RTN_UNICAST = 4, 1


def add_route(route: Route, oif: int) -> None:
    """The route through the link `oif`, static, scope global unless its extras say."""
    table = route.extras.get("table", MAIN_TABLE)
    header = RTMSG.pack(
        ADDRESS_FAMILIES[route.dst.version],
        route.dst.prefixlen,
        0,
        0,
        table if table < 256 else RT_TABLE_COMPAT,
        RTPROT_STATIC,
        route.extras.get("scope", 0),
        RTN_UNICAST,
        0,
    )
    body = header + attribute(RTA_DST, route.dst.network_address.packed)
    body += attribute(RTA_OIF, U32.pack(oif)) + attribute(RTA_TABLE, U32.pack(table))
    if route.gw is not None:
        body += attribute(RTA_GATEWAY, route.gw.packed)
    if "priority" in route.extras:
        body += attribute(RTA_PRIORITY, U32.pack(route.extras["priority"]))
    metrics = b"".join(
        attribute(kind, U32.pack(route.extras[name]))
        for name, kind in METRICS.items()
        if name in route.extras
    )
    if metrics:
        body += attribute(RTA_METRICS, metrics, nested=True)
    request(_socket.NETLINK_ROUTE, RTM_NEWROUTE, body, CREATE_NEW)


class TableRoute(Record):
    """A route of one table's dump: its link 0 when it names none."""

    __slots__ = ("dst", "gateway", "oif", "protocol")

    def __init__(self, dst: IPNetwork, gateway: str | None, oif: int, protocol: int) -> None:
        self.dst = dst
        self.gateway = gateway
        self.oif = oif
        self.protocol = protocol


def table_routes(sock: NetlinkSocket, table: int) -> list[TableRoute]:
    """The routes of one routing table, both families, in one dump (AF_UNSPEC: the kernel dumps
    every family's); multipath ones without their gateways."""
    families = set(ADDRESS_FAMILIES.values())

    def read(kind: int, payload: memoryview) -> TableRoute | None:
        if kind != RTM_NEWROUTE or len(payload) < RTMSG.size:
            return None
        family, dst_len, _, _, short_table, protocol, _, _, _ = RTMSG.unpack_from(payload)
        attrs = attributes(payload[RTMSG.size :])
        of_table = U32.unpack(attrs[RTA_TABLE])[0] if RTA_TABLE in attrs else short_table
        if family not in families or of_table != table:
            return None
        any_address = bytes(16 if family == _socket.AF_INET6 else 4)
        dst = _socket.inet_ntop(family, attrs.get(RTA_DST, any_address))
        gateway = attrs.get(RTA_GATEWAY)
        return TableRoute(
            ipaddress.ip_network(f"{dst}/{dst_len}"),
            _socket.inet_ntop(family, gateway) if gateway is not None else None,
            U32.unpack(attrs[RTA_OIF])[0] if RTA_OIF in attrs else 0,
            protocol,
        )

    every_family = RTMSG.pack(_socket.AF_UNSPEC, 0, 0, 0, 0, 0, 0, 0, 0)
    return sock.dump(RTM_GETROUTE, every_family, read)


def routes(oif: int, table: int) -> list[tuple[IPNetwork, str | None]]:
    """(destination, gateway) of the routes through the link in one routing table."""
    with NetlinkSocket(_socket.NETLINK_ROUTE) as sock:
        return [(r.dst, r.gateway) for r in table_routes(sock, table) if r.oif == oif]
