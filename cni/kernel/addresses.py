"""The addresses of a link, or of every link, in the calling thread's network namespace: one
RTM_GETADDR dump read with rawnetlink (standard library only), the reader shared by the plugin
(its bridge's and its pods' addresses, through cni.links) and the node daemon (its node's
addresses: on an IPVS node every service address is one)."""

from __future__ import annotations

import _socket  # not socket: see cni.kernel.rawnetlink
import struct

from cni.kernel.families import ADDRESS_FAMILIES
from cni.kernel.rawnetlink import NetlinkSocket, attributes

RTM_NEWADDR, RTM_GETADDR = 20, 22
IFADDRMSG = struct.Struct("=BBBBI")
"""ifaddrmsg: family, prefix length, flags, scope, link index."""
IFA_ADDRESS, IFA_LOCAL = 1, 2


class LinkAddress(tuple[int, str, int, int]):
    """One address of a link: (link, address, prefix_length, scope), a tuple with named fields
    as a NamedTuple's, which would import typing: ~2 ms of every in-process call of the plugin
    (docs/benchmarks.md#the-in-process-path)."""

    __slots__ = ()

    def __new__(cls, link: int, address: str, prefix_length: int, scope: int) -> LinkAddress:
        return super().__new__(cls, (link, address, prefix_length, scope))

    @property
    def link(self) -> int:
        """The link's index."""
        return self[0]

    @property
    def address(self) -> str:
        """The local address where the kernel gives one apart (a point-to-point link's other is
        its peer's)."""
        return self[1]

    @property
    def prefix_length(self) -> int:
        return self[2]

    @property
    def scope(self) -> int:
        """The kernel's: 0 global (RT_SCOPE_UNIVERSE), 253 link, 254 host."""
        return self[3]

    def __repr__(self) -> str:
        return (
            f"LinkAddress(link={self.link}, address={self.address!r}, "
            f"prefix_length={self.prefix_length}, scope={self.scope})"
        )


def link_addresses(family: int | None = None, index: int | None = None) -> list[LinkAddress]:
    """The addresses of one family (4 or 6; None: both) on the link with that index (None:
    every link's), in one dump. A link's are picked by the kernel where it checks requests
    strictly (Linux 4.20 and later), elsewhere here: beside another link's thousands (an IPVS
    dummy link's), the kernel's pick spares reading them at all, and picking here still spares
    decoding them all as pyroute2 does (docs/benchmarks.md#on-a-crowded-node)."""
    address_family = _socket.AF_UNSPEC if family is None else ADDRESS_FAMILIES[family]
    wanted = set(ADDRESS_FAMILIES.values()) if family is None else {address_family}

    def read(kind: int, payload: memoryview) -> LinkAddress | None:
        if kind != RTM_NEWADDR or len(payload) < IFADDRMSG.size:
            return None
        of_family, prefix_length, _, scope, of_link = IFADDRMSG.unpack_from(payload)
        if of_family not in wanted or (index is not None and of_link != index):
            return None
        found = attributes(payload[IFADDRMSG.size :])
        address = found.get(IFA_LOCAL, found.get(IFA_ADDRESS))
        if address is None:
            return None
        try:
            return LinkAddress(of_link, _socket.inet_ntop(of_family, address), prefix_length, scope)
        except ValueError:  # not an address of the family's length
            return None

    with NetlinkSocket(_socket.NETLINK_ROUTE) as sock:
        if index is not None:
            sock.check_strictly()
        request = IFADDRMSG.pack(address_family, 0, 0, 0, index or 0)
        return sock.dump(RTM_GETADDR, request, read)
