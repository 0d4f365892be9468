"""Thin helpers over netlink: look links up and delete them by name, and a link's addresses,
with rawnetlink (one request each, read with struct: through pyroute2 a request costs ~0.9 ms
here, which a pod's ADD paid seven times); routes through pyroute2's IPRoute; netlink errors
turned into CNI ones. Each works in the calling thread's network namespace."""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from cni.addresses import link_addresses
from cni.errors import CniError, Code
from cni.rawnetlink import NetlinkSocket, RawNetlinkError, attribute, attributes
from cni.result import IPInterface, IPNetwork

MAIN_TABLE = 254
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
IFINFOMSG = struct.Struct("=BxHiII")
"""ifinfomsg: family, device type, index, flags, change mask."""
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU, IFLA_MASTER, IFLA_LINKINFO = 1, 3, 4, 10, 18
IFLA_INFO_KIND = 1
U32 = struct.Struct("=I")


@dataclass(frozen=True)
class Link:
    index: int
    name: str
    kind: str
    mac: str
    mtu: int
    master: int | None
    flags: int


@contextmanager
def netlink_errors(action: str) -> Iterator[None]:
    try:
        yield
    except (NetlinkError, RawNetlinkError) as err:
        raise CniError(Code.NETLINK_FAILURE, f"{action}: {err}") from err


def ignoring(code: int, call: Callable[[], Any]) -> None:
    """Run a netlink call for which one errno (EEXIST, ENODEV, ...) means "already done"."""
    try:
        call()
    except NetlinkError as err:
        if err.code != code:
            raise


def link_by_name(name: str) -> Link | None:
    """The link of that name, or None."""
    try:
        with NetlinkSocket(socket.NETLINK_ROUTE) as sock:
            replies = sock.request(RTM_GETLINK, _named(name))
    except RawNetlinkError as err:
        if err.errno == errno.ENODEV:
            return None
        raise CniError(Code.NETLINK_FAILURE, f"cannot look up {name}: {err}") from err
    for kind, payload in replies:
        if kind == RTM_NEWLINK and len(payload) >= IFINFOMSG.size:
            return _link(payload)
    return None


def delete_link(name: str) -> bool:
    """Remove the link of that name (a veth: both ends); False when there was none."""
    try:
        with NetlinkSocket(socket.NETLINK_ROUTE) as sock:
            sock.request(RTM_DELLINK, _named(name))
    except RawNetlinkError as err:
        if err.errno == errno.ENODEV:
            return False
        raise CniError(Code.NETLINK_FAILURE, f"cannot delete {name}: {err}") from err
    return True


def _named(name: str) -> bytes:
    """A link request's body naming the link (index 0: the kernel looks the name up)."""
    header = IFINFOMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
    return header + attribute(IFLA_IFNAME, name.encode() + b"\0")


def _link(payload: memoryview) -> Link:
    _, _, index, flags, _ = IFINFOMSG.unpack_from(payload)
    found = attributes(payload[IFINFOMSG.size :])
    info = attributes(found[IFLA_LINKINFO]) if IFLA_LINKINFO in found else {}
    master = found.get(IFLA_MASTER)
    mtu = found.get(IFLA_MTU)
    return Link(
        index=index,
        name=_string(found.get(IFLA_IFNAME)),
        kind=_string(info.get(IFLA_INFO_KIND)),
        mac=":".join(f"{byte:02x}" for byte in found.get(IFLA_ADDRESS, b"")),
        mtu=U32.unpack(mtu)[0] if mtu is not None else 0,
        master=U32.unpack(master)[0] if master is not None else None,
        flags=flags,
    )


def _string(payload: memoryview | None) -> str:
    return bytes(payload or b"").rstrip(b"\0").decode(errors="replace")


def addresses(index: int) -> list[IPInterface]:
    """The global addresses (scope 0) of a link in the calling thread's network namespace, both
    families, with their prefix lengths (a point-to-point address: its own end, not the
    peer's)."""
    return [
        ipaddress.ip_interface(f"{a.address}/{a.prefix_length}")
        for a in link_addresses(index=index)
        if a.scope == 0
    ]


def routes(ipr: IPRoute, index: int, table: int) -> list[tuple[IPNetwork, str | None]]:
    """(destination, gateway) of the routes through the link in one routing table."""
    found = []
    for family, any_net in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        for msg in ipr.get_routes(family=family, table=table, oif=index):
            dst = ipaddress.ip_network(f"{msg.get_attr('RTA_DST') or any_net}/{msg['dst_len']}")
            found.append((dst, msg.get_attr("RTA_GATEWAY")))
    return found
