"""Node networking's netlink requests, encoded and read with struct (cni.kernel.rawnetlink):
the main table's routes, a route lookup, the VXLAN device, its forwarding (fdb) and neighbour
entries, the node's link names and a link's MTU. Each is one request or dump on the socket
it is given, in the network namespace of the thread that opened it; a refusal raises
RawNetlinkError, its errno the kernel's.

pyroute2 made these requests before: its import alone cost the daemon 10.8 MiB and ~80 ms in
every mode (docs/benchmarks.md#where-knit-proxyds-fixed-cost-goes), and it decoded every
attribute of every message. The IPVS mode still uses it, for IPVS and ipsets."""

from __future__ import annotations

import _socket  # not socket: see cni.kernel.rawnetlink
import errno
import ipaddress
import struct
from typing import NamedTuple

from cni.kernel.rawnetlink import (
    CREATE_NEW,
    U32,
    NetlinkSocket,
    RawNetlinkError,
    attribute,
    attributes,
)
from cni.links import (
    IFINFOMSG,
    IFLA_ADDRESS,
    IFLA_IFNAME,
    IFLA_INFO_DATA,
    IFLA_INFO_KIND,
    IFLA_LINKINFO,
    IFLA_MTU,
    NDA_DST,
    NDMSG,
    RTM_DELLINK,
    RTM_GETLINK,
    RTM_NEWLINK,
    U8,
)
from cni.routes import RT_TABLE_COMPAT, RTA_DST, RTA_GATEWAY, RTA_OIF, RTA_TABLE, RTMSG, RTN_UNICAST

RTM_NEWROUTE, RTM_DELROUTE, RTM_GETROUTE = 24, 25, 26
RTM_NEWNEIGH, RTM_DELNEIGH, RTM_GETNEIGH = 28, 29, 30
REPLACE = 0x100 | 0x400
"""NLM_F_REPLACE | NLM_F_CREATE: write the object, whether it exists or not."""
IFLA_VXLAN_ID, IFLA_VXLAN_LOCAL, IFLA_VXLAN_LEARNING = 1, 4, 7
IFLA_VXLAN_PORT, IFLA_VXLAN_LOCAL6 = 15, 17
RT_SCOPE_UNIVERSE, RT_SCOPE_NOWHERE = 0, 255
"""A gateway route's scope; a deletion's, which matches a route of any scope."""
NDA_LLADDR, NDA_PORT, NDA_VNI, NDA_IFINDEX = 2, 6, 7, 8
BE16 = struct.Struct(">H")


class Neighbour(NamedTuple):
    """A neighbour entry (an IP family's) or a forwarding entry (AF_BRIDGE's) of a link."""

    dst: str
    """The neighbour's address; a forwarding entry's remote address, "" for none."""
    mac: str
    state: int
    port: int | None
    """A forwarding entry's remote port, given only where it differs from the device's."""
    vni: int | None
    """Likewise its VNI."""


def route_socket() -> NetlinkSocket:
    """A NETLINK_ROUTE socket for these requests, in the calling thread's namespace."""
    return NetlinkSocket(_socket.NETLINK_ROUTE)


def _family(address: str) -> int:
    return _socket.AF_INET6 if ":" in address else _socket.AF_INET


def _packed(address: str) -> bytes:
    return _socket.inet_pton(_family(address), address)


def _text(family: int, payload: memoryview | bytes) -> str:
    return _socket.inet_ntop(family, bytes(payload))


def _mac(payload: memoryview | bytes) -> str:
    return ":".join(f"{byte:02x}" for byte in bytes(payload))


def _mac_bytes(mac: str) -> bytes:
    return bytes.fromhex(mac.replace(":", ""))


def route_gateway(sock: NetlinkSocket, address: str) -> str:
    """The gateway of the route the kernel takes to address ("" when it is on a link);
    RawNetlinkError when it has none."""
    family = _family(address)
    header = RTMSG.pack(family, 128 if family == _socket.AF_INET6 else 32, 0, 0, 0, 0, 0, 0, 0)
    for kind, payload in sock.request(RTM_GETROUTE, header + attribute(RTA_DST, _packed(address))):
        if kind == RTM_NEWROUTE and len(payload) >= RTMSG.size:
            gateway = attributes(payload[RTMSG.size :]).get(RTA_GATEWAY)
            return _text(family, gateway) if gateway is not None else ""
    raise RawNetlinkError(errno.ENETUNREACH, f"no route to {address}")


def _route(cidr: str, gateway: str, protocol: int, table: int, scope: int, flags: int) -> bytes:
    network = ipaddress.ip_network(cidr)
    family = _family(str(network.network_address))
    header = RTMSG.pack(
        family,
        network.prefixlen,
        0,
        0,
        table if table < 256 else RT_TABLE_COMPAT,
        protocol,
        scope,
        RTN_UNICAST if scope != RT_SCOPE_NOWHERE else 0,
        flags,
    )
    body = header + attribute(RTA_DST, network.network_address.packed)
    body += attribute(RTA_TABLE, U32.pack(table))
    return body + (attribute(RTA_GATEWAY, _packed(gateway)) if gateway else b"")


def add_route(
    sock: NetlinkSocket,
    cidr: str,
    gateway: str,
    protocol: int,
    table: int,
    oif: int = 0,
    flags: int = 0,
) -> None:
    """A new route (EEXIST when one holds the destination); flags: rtm_flags (RTNH_F_ONLINK)."""
    body = _route(cidr, gateway, protocol, table, RT_SCOPE_UNIVERSE, flags)
    if oif:
        body += attribute(RTA_OIF, U32.pack(oif))
    sock.request(RTM_NEWROUTE, body, CREATE_NEW)


def delete_route(
    sock: NetlinkSocket, cidr: str, gateway: str, protocol: int, table: int, oif: int = 0
) -> None:
    """The route of that destination, gateway and link, only if of that protocol: the kernel
    matches it, so no other route goes."""
    body = _route(cidr, gateway, protocol, table, RT_SCOPE_NOWHERE, 0)
    if oif:
        body += attribute(RTA_OIF, U32.pack(oif))
    sock.request(RTM_DELROUTE, body)


def link_mtu(sock: NetlinkSocket, index: int) -> int:
    header = IFINFOMSG.pack(_socket.AF_UNSPEC, 0, index, 0, 0)
    for kind, payload in sock.request(RTM_GETLINK, header):
        if kind == RTM_NEWLINK and len(payload) >= IFINFOMSG.size:
            mtu = attributes(payload[IFINFOMSG.size :]).get(IFLA_MTU)
            if mtu is not None:
                return int(U32.unpack(mtu)[0])
    raise LookupError(f"the kernel gave no MTU for link {index}")


def link_names(sock: NetlinkSocket) -> set[str]:
    def read(kind: int, payload: memoryview) -> str | None:
        if kind != RTM_NEWLINK or len(payload) < IFINFOMSG.size:
            return None
        name = attributes(payload[IFINFOMSG.size :]).get(IFLA_IFNAME)
        return bytes(name).rstrip(b"\0").decode(errors="replace") if name is not None else None

    return set(sock.dump(RTM_GETLINK, IFINFOMSG.pack(_socket.AF_UNSPEC, 0, 0, 0, 0), read))


def create_vxlan(
    sock: NetlinkSocket, name: str, vni: int, port: int, local: str, mac: str, mtu: int
) -> None:
    """A VXLAN device without learning, sending from `local` to `port` (EEXIST if the name is
    taken)."""
    local_kind = IFLA_VXLAN_LOCAL6 if _family(local) == _socket.AF_INET6 else IFLA_VXLAN_LOCAL
    data = (
        attribute(IFLA_VXLAN_ID, U32.pack(vni))
        + attribute(local_kind, _packed(local))
        + attribute(IFLA_VXLAN_LEARNING, U8.pack(0))
        + attribute(IFLA_VXLAN_PORT, BE16.pack(port))
    )
    info = attribute(IFLA_INFO_KIND, b"vxlan") + attribute(IFLA_INFO_DATA, data, nested=True)
    body = IFINFOMSG.pack(_socket.AF_UNSPEC, 0, 0, 0, 0)
    body += attribute(IFLA_IFNAME, name.encode() + b"\0")
    body += attribute(IFLA_ADDRESS, _mac_bytes(mac)) + attribute(IFLA_MTU, U32.pack(mtu))
    sock.request(RTM_NEWLINK, body + attribute(IFLA_LINKINFO, info, nested=True), CREATE_NEW)


def delete_link(sock: NetlinkSocket, index: int) -> None:
    sock.request(RTM_DELLINK, IFINFOMSG.pack(_socket.AF_UNSPEC, 0, index, 0, 0))


def neighbours(sock: NetlinkSocket, index: int, family: int) -> list[Neighbour]:
    """The link's entries of one family: _socket.AF_BRIDGE for its forwarding entries."""

    def read(kind: int, payload: memoryview) -> Neighbour | None:
        if kind != RTM_NEWNEIGH or len(payload) < NDMSG.size:
            return None
        of_family, of_index, state, _, _ = NDMSG.unpack_from(payload)
        if of_family != family or of_index != index:
            return None
        attrs = attributes(payload[NDMSG.size :])
        dst = attrs.get(NDA_DST)
        port, vni = attrs.get(NDA_PORT), attrs.get(NDA_VNI)
        return Neighbour(
            _text(_socket.AF_INET6 if len(dst) == 16 else _socket.AF_INET, dst) if dst else "",
            _mac(attrs.get(NDA_LLADDR, b"")),
            state,
            BE16.unpack(port)[0] if port is not None else None,
            U32.unpack(vni)[0] if vni is not None else None,
        )

    # The kernel filters an IP family's dump by NDA_IFINDEX (not by the header's index, which
    # a strictly checked dump must leave 0); it sends every link's forwarding entries.
    request = NDMSG.pack(family, 0, 0, 0, 0) + attribute(NDA_IFINDEX, U32.pack(index))
    return sock.dump(RTM_GETNEIGH, request, read)


def write_neighbour(
    sock: NetlinkSocket, family: int, index: int, dst: str, mac: str, state: int, flags: int = 0
) -> None:
    """Write (replace) an entry: an IP family's, dst -> mac; AF_BRIDGE's, mac -> remote dst."""
    body = NDMSG.pack(family, index, state, flags, 0)
    body += attribute(NDA_DST, _packed(dst)) + attribute(NDA_LLADDR, _mac_bytes(mac))
    sock.request(RTM_NEWNEIGH, body, REPLACE)


def delete_neighbour(
    sock: NetlinkSocket,
    family: int,
    index: int,
    dst: str,
    mac: str = "",
    flags: int = 0,
    port: int | None = None,
    vni: int | None = None,
) -> None:
    """Delete an entry: an IP family's by dst; AF_BRIDGE's by mac, remote dst, port and VNI."""
    body = NDMSG.pack(family, index, 0, flags, 0) + attribute(NDA_DST, _packed(dst))
    if mac:
        body += attribute(NDA_LLADDR, _mac_bytes(mac))
    if port is not None:
        body += attribute(NDA_PORT, BE16.pack(port))
    if vni is not None:
        body += attribute(NDA_VNI, U32.pack(vni))
    sock.request(RTM_DELNEIGH, body)
