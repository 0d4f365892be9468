"""Conntrack entries read and deleted through netlink (ctnetlink, with rawnetlink): the proxy's
clean-up of stale UDP entries, and the flows a policy change cuts (policy/cutter.py).

UDP has no connection end, so a client keeps sending to an endpoint that is gone for as long
as its conntrack entry lives. After a sync, entries whose original destination is a service
frontend and whose reply source is not one of that frontend's endpoints are deleted; that
covers both an endpoint going away and a service gaining endpoints after having none (the
entry then points at the frontend itself).

TCP and SCTP entries to those frontends are deleted on the same test, but only while they saw
no reply, so no working connection is one of them. A connection attempt that got no answer
leaves an entry (TCP's SYN_SENT lives 120 s): one made before the proxy wrote the frontend's
rules (not DNATed, routed away), or one DNATed to an endpoint that was going away. A later
attempt from the same client reusing that source port for that frontend matches the entry
and goes where the first went, to time out as well.

The kernel picks the entries to look at: one dump per frontend port, filtered on it
(CTA_FILTER, Linux 5.8 and later), costs a walk of the whole table in the kernel, far less
per entry than reading an entry of the dump here costs
(docs/benchmarks.md#netlink-make-bench-netlink). Past
FILTERED_DUMPS_UP_TO ports (a full sync of many UDP services), past KERNEL_WALK_BUDGET entries
walked in all by two or more dumps (a table of mostly TCP entries), or on a kernel that ignores
the filter, one dump of the family's entries of the protocol is asked for instead (for TCP
and SCTP, of unanswered ones only).
An entry is deleted by its original tuple, zone and id as the dump gave them, so an entry of
another conntrack zone goes too and a newer entry that took the tuple meanwhile stays.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import re
import socket
import struct
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from cni import ip_text
from cni.kernel.families import ADDRESS_FAMILIES
from cni.kernel.rawnetlink import (
    NETLINK_NETFILTER,
    NFGENMSG,
    NetlinkSocket,
    RawNetlinkError,
    attribute,
    attributes,
)

log = logging.getLogger(__name__)

Address = tuple[str, int]
FILTERED_DUMPS_UP_TO = 16
KERNEL_WALK_BUDGET = 2_000_000

CTNETLINK = 1 << 8
"""The conntrack subsystem's part of a message type."""
MSG_NEW, MSG_GET, MSG_DELETE = CTNETLINK, CTNETLINK | 1, CTNETLINK | 2
"""A dump returns its entries as MSG_NEW messages."""
MSG_GET_STATS = CTNETLINK | 5
CTA_TUPLE_ORIG, CTA_TUPLE_REPLY, CTA_STATUS, CTA_MARK, CTA_ID, CTA_ZONE = 1, 2, 3, 8, 12, 18
CTA_MARK_MASK, CTA_FILTER, CTA_STATUS_MASK = 21, 25, 26
IPS_SEEN_REPLY = 1 << 1
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_FILTER_ORIG_FLAGS, CTA_FILTER_REPLY_FLAGS = 1, 2
FILTER_IP_SRC, FILTER_PROTO_NUM, FILTER_DST_PORT = 1 << 0, 1 << 3, 1 << 5
CTA_STATS_GLOBAL_ENTRIES = 1
SOURCE, DESTINATION = 0, 1
"""A tuple's ends, indexing IP_ENDS' pairs and PORT_ENDS."""
IP_ENDS: dict[int, tuple[int, int]] = {socket.AF_INET: (1, 2), socket.AF_INET6: (3, 4)}
"""CTA_IP_V4_SRC and _DST, CTA_IP_V6_SRC and _DST."""
PORT_ENDS = (CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT)
IDENTITY = (CTA_TUPLE_ORIG, CTA_ID, CTA_ZONE)
"""What names an entry to delete or change: its original tuple, id (so a newer entry that took
the tuple stays) and zone."""
PORT = struct.Struct(">H")
U32 = struct.Struct(">I")
"""A mark or status, as ctnetlink packs them."""
T = TypeVar("T")


@functools.cache
def kernel_filters_dumps() -> bool:
    """Whether this kernel filters conntrack dumps on a tuple (Linux 5.8)."""
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return release is not None and (int(release[1]), int(release[2])) >= (5, 8)


@dataclass(frozen=True)
class Entry:
    """What the clean-up reads of one conntrack entry, and how to name it to delete it."""

    destination: Address
    """The original direction's destination."""
    reply_source: Address
    delete_request: bytes
    """The request deleting this entry: its original tuple, id and zone as dumped."""


@dataclass
class Frontends:
    """Service frontends of one family and protocol, and the endpoints that may answer for
    them."""

    family: int
    by_address: dict[Address, set[Address]] = field(default_factory=dict)
    by_node_port: dict[int, set[Address]] = field(default_factory=dict)
    local_addresses: set[str] = field(default_factory=set)

    def stale(self, destination: Address, reply_source: Address) -> bool:
        allowed = self.by_address.get(destination)
        if allowed is None and destination[0] in self.local_addresses:
            allowed = self.by_node_port.get(destination[1])
        return allowed is not None and reply_source not in allowed

    def __bool__(self) -> bool:
        return bool(self.by_address or self.by_node_port)

    @property
    def address_family(self) -> int:
        return ADDRESS_FAMILIES[self.family]

    def dump_ports(self, entries_in_table: Callable[[], int]) -> list[int] | list[None]:
        """The destination ports the kernel is asked for UDP entries to, one dump each; [None]:
        one dump of the family's UDP entries (see the module's notes). The table's size is asked
        only when it decides: a single port's dump walks the table as the family's would, and
        sends less. Ports alone: a filter naming an IPv6 destination address, sent through
        pyroute2, matched no entry here (kernel 6.18), where the same filter on the port did."""
        ports = sorted({p for _, p in self.by_address} | self.by_node_port.keys())
        if len(ports) > FILTERED_DUMPS_UP_TO or not kernel_filters_dumps():
            return [None]
        if len(ports) > 1 and len(ports) * entries_in_table() > KERNEL_WALK_BUDGET:
            return [None]
        return ports


def dump_request(
    address_family: int,
    port: int | None,
    protocol: int = socket.IPPROTO_UDP,
    unanswered: bool = False,
) -> bytes:
    """A dump request for the family's entries of `protocol` (to `port`; `unanswered`: that saw
    no reply), filtered by the kernel (the tuple Linux 5.8 and later, the status 5.19 and later;
    older ones skip the attributes they do not know, and entries are checked again as read)."""
    proto = attribute(CTA_PROTO_NUM, bytes([protocol]))
    flags = FILTER_PROTO_NUM
    if port is not None:
        proto += attribute(CTA_PROTO_DST_PORT, PORT.pack(port))
        flags |= FILTER_DST_PORT
    tuple_orig = attribute(CTA_TUPLE_PROTO, proto, nested=True)
    filter_flags = attribute(CTA_FILTER_ORIG_FLAGS, struct.pack("=I", flags))
    status = (
        attribute(CTA_STATUS, U32.pack(0)) + attribute(CTA_STATUS_MASK, U32.pack(IPS_SEEN_REPLY))
        if unanswered
        else b""
    )
    return (
        NFGENMSG.pack(address_family, 0, 0)
        + attribute(CTA_TUPLE_ORIG, tuple_orig, nested=True)
        + attribute(CTA_FILTER, filter_flags, nested=True)
        + status
    )


PROTOCOLS = {socket.IPPROTO_TCP: "tcp", socket.IPPROTO_UDP: "udp", socket.IPPROTO_SCTP: "sctp"}
"""The protocols whose entries are read, as nft names them."""


def tuple_end(
    tuple_attributes: memoryview | None, address_family: int, end: int
) -> tuple[int, Address]:
    """A tuple's protocol number and one end (SOURCE or DESTINATION); ValueError (or
    struct.error) unless the tuple has that end's address and port."""
    found = attributes(tuple_attributes) if tuple_attributes is not None else {}
    ip = attributes(found[CTA_TUPLE_IP]) if CTA_TUPLE_IP in found else {}
    proto = attributes(found[CTA_TUPLE_PROTO]) if CTA_TUPLE_PROTO in found else {}
    number = bytes(proto.get(CTA_PROTO_NUM, b""))
    address = ip.get(IP_ENDS[address_family][end])
    port = proto.get(PORT_ENDS[end])
    if len(number) != 1 or address is None or port is None:
        raise ValueError("a tuple without its protocol, address or port")
    return number[0], (socket.inet_ntop(address_family, address), PORT.unpack(port)[0])


def _dump(
    sock: NetlinkSocket,
    address_family: int,
    request: bytes,
    read_entry: Callable[[dict[int, memoryview]], T | None],
) -> list[T]:
    """The entries of a dump that `read_entry` makes something of, given an entry's
    attributes; entries it cannot read (ValueError, struct.error) are skipped."""

    def read(kind: int, payload: memoryview) -> T | None:
        if kind != MSG_NEW or len(payload) < NFGENMSG.size or payload[0] != address_family:
            return None
        try:
            return read_entry(attributes(payload[NFGENMSG.size :]))
        except (ValueError, struct.error):
            return None

    return sock.dump(MSG_GET, request, read)


def identity(found: dict[int, memoryview], address_family: int) -> bytes:
    """What names an entry in a request (see IDENTITY), from its attributes as dumped."""
    named = (
        attribute(name, bytes(found[name]), nested=name == CTA_TUPLE_ORIG)
        for name in IDENTITY
        if name in found
    )
    return NFGENMSG.pack(address_family, 0, 0) + b"".join(named)


def _source_address(tuple_attributes: memoryview | None, address_family: int) -> bytes | None:
    """A tuple's source address as the kernel packs it, read no further than that."""
    if tuple_attributes is None:
        return None
    ip = attributes(tuple_attributes).get(CTA_TUPLE_IP)
    address = attributes(ip).get(IP_ENDS[address_family][SOURCE]) if ip is not None else None
    return bytes(address) if address is not None else None


def entries(
    sock: NetlinkSocket,
    address_family: int,
    port: int | None,
    keep: Callable[[Address, Address], bool],
    protocol: int = socket.IPPROTO_UDP,
    unanswered: bool = False,
) -> list[Entry]:
    """The family's entries of `protocol` (to `port`; `unanswered`: that saw no reply) whose
    original destination and reply source `keep` keeps; messages that are not whole entries of
    that protocol are skipped."""

    def read(found: dict[int, memoryview]) -> Entry | None:
        number, destination = tuple_end(found.get(CTA_TUPLE_ORIG), address_family, DESTINATION)
        _, reply_source = tuple_end(found.get(CTA_TUPLE_REPLY), address_family, SOURCE)
        status = U32.unpack(found[CTA_STATUS])[0] if CTA_STATUS in found else IPS_SEEN_REPLY
        if number != protocol or (unanswered and status & IPS_SEEN_REPLY):
            return None
        if not keep(destination, reply_source):
            return None
        return Entry(destination, reply_source, identity(found, address_family))

    request = dump_request(address_family, port, protocol, unanswered)
    return _dump(sock, address_family, request, read)


@dataclass(frozen=True)
class Flow:
    """A TCP, UDP or SCTP entry as the forward hook saw its first packet: from its original
    source to its reply's source (the destination after any DNAT, before any masquerade on the
    way out), on the reply's source port; with its conntrack mark."""

    protocol: str
    source: Address
    destination: Address
    mark: int
    identity: bytes
    """What names the entry in a request: its original tuple, id and zone as dumped."""


def flows(
    sock: NetlinkSocket,
    address_family: int,
    keep: Callable[[Flow], bool],
    marked: int = 0,
    ends: Collection[bytes] | None = None,
) -> list[Flow]:
    """The family's TCP, UDP and SCTP entries that `keep` keeps; with `marked`, only those
    whose mark has all of these bits (the kernel picks them); with `ends`, only those whose
    original or reply source is one of these packed addresses (the others are not decoded:
    in a crowded table, most entries are not looked at further)."""

    request = NFGENMSG.pack(address_family, 0, 0)
    if marked:
        request += attribute(CTA_MARK, U32.pack(marked)) + attribute(
            CTA_MARK_MASK, U32.pack(marked)
        )
    return _dump(sock, address_family, request, _flow_reader(address_family, keep, ends))


def flows_of(sock: NetlinkSocket, address_family: int, address: bytes) -> list[Flow]:
    """The family's TCP, UDP and SCTP entries from or to this packed address (its original or
    reply source): two dumps the kernel filters on that source (Linux 5.8 and later; older
    kernels return every entry, checked again as read)."""
    found: dict[bytes, Flow] = {}
    for direction, flags in (
        (CTA_TUPLE_ORIG, CTA_FILTER_ORIG_FLAGS),
        (CTA_TUPLE_REPLY, CTA_FILTER_REPLY_FLAGS),
    ):
        source = attribute(IP_ENDS[address_family][SOURCE], address)
        request = (
            NFGENMSG.pack(address_family, 0, 0)
            + attribute(direction, attribute(CTA_TUPLE_IP, source, nested=True), nested=True)
            + attribute(CTA_FILTER, attribute(flags, struct.pack("=I", FILTER_IP_SRC)), nested=True)
        )
        reader = _flow_reader(address_family, lambda _: True, {address})
        found.update((flow.identity, flow) for flow in _dump(sock, address_family, request, reader))
    return list(found.values())


def _flow_reader(
    address_family: int, keep: Callable[[Flow], bool], ends: Collection[bytes] | None
) -> Callable[[dict[int, memoryview]], Flow | None]:
    def read(found: dict[int, memoryview]) -> Flow | None:
        if ends is not None and not (
            _source_address(found.get(CTA_TUPLE_ORIG), address_family) in ends
            or _source_address(found.get(CTA_TUPLE_REPLY), address_family) in ends
        ):
            return None
        protocol, source = tuple_end(found.get(CTA_TUPLE_ORIG), address_family, SOURCE)
        _, destination = tuple_end(found.get(CTA_TUPLE_REPLY), address_family, SOURCE)
        if protocol not in PROTOCOLS:
            return None
        mark = U32.unpack(found[CTA_MARK])[0] if CTA_MARK in found else 0
        flow = Flow(PROTOCOLS[protocol], source, destination, mark, identity(found, address_family))
        return flow if keep(flow) else None

    return read


def mark(sock: NetlinkSocket, entries: Iterable[Flow], bits: int, on: bool) -> int:
    """Set (`on`) or clear these bits of the entries' marks, leaving the other bits as they
    are; returns how many entries were changed."""
    change = attribute(CTA_MARK, U32.pack(bits if on else 0)) + attribute(
        CTA_MARK_MASK, U32.pack(bits)
    )
    return _each(sock, MSG_NEW, (entry.identity + change for entry in entries), "marking a")


def delete(sock: NetlinkSocket, requests: Iterable[bytes], what: str) -> int:
    """Delete entries by their delete requests; returns how many were deleted."""
    return _each(sock, MSG_DELETE, requests, f"deleting a {what}")


def _each(sock: NetlinkSocket, kind: int, requests: Iterable[bytes], what: str) -> int:
    """Send each request; returns how many the kernel did (an entry that expired meanwhile is
    not counted; another failure is logged, naming `what` was being done)."""
    done = 0
    for request in requests:
        try:
            sock.request(kind, request)
            done += 1
        except RawNetlinkError as err:
            if err.errno != errno.ENOENT:  # ENOENT: expired meanwhile
                log.warning("%s conntrack entry failed: %s", what, err)
    return done


def table_size(sock: NetlinkSocket) -> int:
    """How many entries the kernel's table holds, of every family."""
    for _, payload in sock.request(MSG_GET_STATS, NFGENMSG.pack(socket.AF_UNSPEC, 0, 0)):
        entries = attributes(payload[NFGENMSG.size :]).get(CTA_STATS_GLOBAL_ENTRIES)
        if entries is not None and len(entries) == 4:
            count: int
            (count,) = U32.unpack(entries)
            return count
    return 0


def forget_addresses(addresses: Iterable[str]) -> int:
    """Delete every TCP, UDP and SCTP entry from or to the addresses (a pod's new addresses:
    see policy/admission.py), through one socket; returns how many were deleted."""
    deleted = 0
    with NetlinkSocket(NETLINK_NETFILTER) as sock:
        for address in map(ip_text.address, addresses):
            found = flows_of(sock, ADDRESS_FAMILIES[address.version], address.packed)
            deleted += delete(sock, (flow.identity for flow in found), "new address's")
    return deleted


def clear_stale(frontends: Frontends) -> int:
    """Delete the stale UDP entries; returns how many were deleted."""
    if not frontends:
        return 0
    with NetlinkSocket(NETLINK_NETFILTER) as sock:
        stale = [
            entry.delete_request
            for port in frontends.dump_ports(lambda: table_size(sock))
            for entry in entries(sock, frontends.address_family, port, frontends.stale)
        ]
        return delete(sock, stale, "stale UDP")


def clear_unanswered(frontends: dict[int, Frontends]) -> int:
    """Delete the entries of each protocol's frontends (TCP, SCTP: by protocol number; one
    family) that saw no reply and that none of the frontend's endpoints answers, dumped as the
    UDP clean-up dumps (per frontend port, the kernel picking unanswered entries): of the
    unanswered attempts any pod can fill the table with, only those to a changed frontend's
    port are read. Returns how many were deleted."""
    with NetlinkSocket(NETLINK_NETFILTER) as sock:
        unanswered = [
            entry.delete_request
            for protocol, of in frontends.items()
            if of
            for port in of.dump_ports(lambda: table_size(sock))
            for entry in entries(sock, of.address_family, port, of.stale, protocol, True)
        ]
        return delete(sock, unanswered, "never answered")
