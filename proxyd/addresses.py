"""The node's own addresses, read through netlink (rawnetlink: on an IPVS node every service
address is one of them)."""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Callable, Iterable

from cni.families import ADDRESS_FAMILIES
from proxyd.model import NodeInfo, family_of
from proxyd.rawnetlink import NetlinkSocket, attributes

RTM_NEWADDR, RTM_GETADDR = 20, 22
IFADDRMSG = struct.Struct("=BBBBI")
"""ifaddrmsg: family, prefix length, flags, scope, link index."""
IFA_ADDRESS, IFA_LOCAL = 1, 2


def link_index(name: str) -> int | None:
    """The index of the link called name; None when there is none."""
    try:
        return socket.if_nametoindex(name)
    except OSError:
        return None


def link_addresses(family: int) -> list[tuple[int, str]]:
    """(link index, address) of every address of the family on the node: one dump. The local
    address where the kernel gives one apart (a point-to-point link's other is its peer's)."""
    address_family = ADDRESS_FAMILIES[family]

    def read(kind: int, payload: memoryview) -> tuple[int, str] | None:
        if kind != RTM_NEWADDR or len(payload) < IFADDRMSG.size:
            return None
        of_family, _, _, _, index = IFADDRMSG.unpack_from(payload)
        found = attributes(payload[IFADDRMSG.size :])
        address = found.get(IFA_LOCAL, found.get(IFA_ADDRESS))
        if of_family != address_family or address is None:
            return None
        try:
            return index, socket.inet_ntop(address_family, address)
        except ValueError:  # not an address of the family's length
            return None

    with NetlinkSocket(socket.NETLINK_ROUTE) as sock:
        return sock.dump(RTM_GETADDR, IFADDRMSG.pack(address_family, 0, 0, 0, 0), read)


def nodeport_addresses(
    selectors: tuple[str, ...],
    family: int,
    node: NodeInfo,
    local: Callable[[], Iterable[tuple[int, str]]],
) -> tuple[str, ...] | None:
    """The addresses of this family that --nodeport-addresses selects: local addresses inside
    the given CIDRs (`local()`: link_addresses' answer, asked only for CIDRs), and the node's
    primary address (its first InternalIP of the family, else its first ExternalIP) for
    `primary`. None (every local address) when nothing in the flag speaks for this family, as
    kube-proxy reads it."""
    networks = [
        ipaddress.ip_network(s, strict=False)
        for s in selectors
        if s != "primary" and family_of(s) == family
    ]
    of_family = (a for a in node.addresses if family_of(a) == family)
    primary = next(of_family, None) if "primary" in selectors else None
    if not networks and primary is None:
        return None
    chosen = {primary} if primary is not None else set()
    if networks:
        for _, address in local():
            if any(ipaddress.ip_address(address) in net for net in networks):
                chosen.add(address)
    return tuple(sorted(chosen))
