"""Netlink requests, dumps and subscriptions encoded and read with struct (standard library
only), for the plugin and the node daemon, where one message per address, flow or packet must
be cheap: a link's addresses or every link's (cni.kernel.addresses: the plugin's bridge, IPVS mode's
dummy link, node networking's uplink MTU), the UDP conntrack clean-up's conversation (its
dumps, the table's size, its deletes), NetworkPolicy's NFLOG denials, and every request of the
plugin's (cni.links, cni.routes) and node networking's (proxyd.nodenet.kernel). pyroute2
decodes every attribute of every message into objects, a request's answer too; what these
callers need is two to six attributes of each, read here alone for a small part of that cost
(docs/benchmarks.md#netlink-make-bench-netlink). IPVS and ipsets stay with pyroute2.

The socket and its constants come from `_socket`, the C module that `socket` wraps: importing
`socket` (its enums and selectors) cost every in-process call of the plugin ~1.8 ms
(docs/benchmarks.md#the-in-process-path), and the plugin's kernel modules take `_socket` too."""

from __future__ import annotations

import _socket
import contextlib
import errno
import os
import struct
from collections.abc import Callable, Iterator
from itertools import count

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Self, TypeVar

    T = TypeVar("T")

HEADER = struct.Struct("=IHHII")
"""nlmsghdr: length, type, flags, sequence, port."""
ATTRIBUTE = struct.Struct("=HH")
"""nlattr: length, type."""
ERROR_CODE = struct.Struct("=i")
U32 = struct.Struct("=I")
"""A native-order u32 attribute's payload."""

REQUEST, ACK, DUMP, DUMP_INTERRUPTED = 0x1, 0x4, 0x300, 0x10
CREATE_NEW = 0x400 | 0x200
"""NLM_F_CREATE | NLM_F_EXCL: create the object, refused with EEXIST when it exists."""
DONE, ERROR = 3, 2
DUMP_ATTEMPTS = 3
"""Times a dump is asked for while the kernel marks it interrupted (its objects changed under
it)."""
ATTRIBUTE_TYPE = 0x3FFF
"""An attribute's type without its nested and byte-order flags."""
NESTED = 0x8000
RECEIVE_BYTES = 1 << 16
NETLINK_NETFILTER = 12
"""Not among the socket module's constants, nor are the two below."""
SOL_NETLINK, NETLINK_GET_STRICT_CHK = 270, 12
SO_RCVBUFFORCE = 33
"""SO_RCVBUF past net.core.rmem_max, for a process with CAP_NET_ADMIN."""
NFGENMSG = struct.Struct(">BBH")
"""nfgenmsg, the header of every netfilter message: family, version, resource id (network
byte order)."""


class RawNetlinkError(OSError):
    """The kernel refused a request, or its answer could not be read; `errno` holds the code
    (pyroute2's NetlinkError, a different class, holds it in `code`)."""


class DumpInterrupted(RawNetlinkError):
    """The kernel marked a dump interrupted: its objects changed while it was read."""


def align(length: int) -> int:
    return (length + 3) & ~3


def attribute(kind: int, payload: bytes, nested: bool = False) -> bytes:
    """One attribute, padded; a nested one's payload is its attributes, concatenated."""
    length = ATTRIBUTE.size + len(payload)
    header = ATTRIBUTE.pack(length, kind | (NESTED if nested else 0))
    return header + payload + bytes(align(length) - length)


def attributes(data: memoryview) -> dict[int, memoryview]:
    """A run of attributes by type (the flags left out), each its payload."""
    found: dict[int, memoryview] = {}
    offset, end = 0, len(data)
    while offset + ATTRIBUTE.size <= end:
        length, kind = ATTRIBUTE.unpack_from(data, offset)
        if length < ATTRIBUTE.size or offset + length > end:
            break
        found[kind & ATTRIBUTE_TYPE] = data[offset + ATTRIBUTE.size : offset + length]
        offset += align(length)
    return found


class NetlinkSocket:
    """One netlink socket of a protocol (NETLINK_ROUTE, NETLINK_NETFILTER), in the
    network namespace of the thread that opens it."""

    def __init__(self, protocol: int) -> None:
        self._socket = _socket.socket(
            _socket.AF_NETLINK, _socket.SOCK_RAW | _socket.SOCK_CLOEXEC, protocol
        )
        try:
            self._socket.bind((0, 0))
        except OSError:
            self._socket.close()
            raise
        self._sequence = count(1)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self._socket.close()

    def check_strictly(self) -> None:
        """Ask the kernel to check this socket's requests strictly, which makes it filter a dump
        by the fields its request sets (a link's index, for one); kernels before 4.20 refuse,
        and then send every object: a caller filters what it reads as well."""
        with contextlib.suppress(OSError):
            self._socket.setsockopt(SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)

    def receive_buffer(self, size: int) -> None:
        """A receive buffer of `size` bytes (the kernel doubles it for its bookkeeping), past
        net.core.rmem_max where the process may, else as far as it allows."""
        try:
            self._socket.setsockopt(_socket.SOL_SOCKET, SO_RCVBUFFORCE, size)
        except PermissionError:
            self._socket.setsockopt(_socket.SOL_SOCKET, _socket.SO_RCVBUF, size)

    def _send(self, kind: int, flags: int, body: bytes) -> int:
        sequence = next(self._sequence)
        length = HEADER.size + len(body)
        self._socket.send(HEADER.pack(length, kind, REQUEST | flags, sequence, 0) + body)
        return sequence

    def _replies(self, sequence: int) -> Iterator[tuple[int, memoryview]]:
        """(type, payload) of each reply to the request, until its end (DONE, or the
        acknowledgement); a refusal, or a dump that failed part way, raises RawNetlinkError, and
        a dump any of whose messages (its DONE among them) the kernel marked interrupted raises
        DumpInterrupted at its end."""
        interrupted = False
        for kind, flags, replied_to, payload in self._received():
            if replied_to != sequence:
                continue
            interrupted |= bool(flags & DUMP_INTERRUPTED)
            if kind in (DONE, ERROR):
                (code,) = ERROR_CODE.unpack_from(payload) if len(payload) >= 4 else (0,)
                if code:
                    raise RawNetlinkError(-code, os.strerror(-code))
                if interrupted:
                    raise DumpInterrupted(errno.EINTR, "netlink: dump interrupted")
                return
            yield kind, payload

    def _received(self) -> Iterator[tuple[int, int, int, memoryview]]:
        """(type, flags, sequence, payload) of each message the socket receives, for ever."""
        while True:
            data = memoryview(self._socket.recv(RECEIVE_BYTES))
            offset = 0
            while offset + HEADER.size <= len(data):
                length, kind, flags, sequence, _ = HEADER.unpack_from(data, offset)
                if length < HEADER.size or offset + length > len(data):
                    raise RawNetlinkError(errno.EPROTO, "netlink: malformed message")
                yield kind, flags, sequence, data[offset + HEADER.size : offset + length]
                offset += align(length)

    def dump(self, kind: int, body: bytes, keep: Callable[[int, memoryview], T | None]) -> list[T]:
        """What `keep` makes of each message (type, payload) a dump request returns, None
        dropped; the dump is read to its end, and asked for again when the kernel marks it
        interrupted."""
        for _ in range(DUMP_ATTEMPTS):
            kept: list[T] = []
            try:
                for message_kind, payload in self._replies(self._send(kind, DUMP, body)):
                    if (item := keep(message_kind, payload)) is not None:
                        kept.append(item)
            except DumpInterrupted:
                continue
            return kept
        raise DumpInterrupted(errno.EINTR, "netlink: every dump was interrupted by changes")

    def messages(self) -> Iterator[tuple[int, memoryview]]:
        """(type, payload) of every message the kernel sends, as it comes (a subscription's)."""
        for kind, _, _, payload in self._received():
            yield kind, payload

    def request(self, kind: int, body: bytes, flags: int = 0) -> list[tuple[int, memoryview]]:
        """(type, payload) of the messages one acknowledged request returns (often none);
        flags: CREATE_NEW for an object that must not exist yet."""
        return list(self._replies(self._send(kind, ACK | flags, body)))


def request(protocol: int, kind: int, body: bytes, flags: int = 0) -> list[tuple[int, memoryview]]:
    """One acknowledged request on a socket of its own (NetlinkSocket.request)."""
    with NetlinkSocket(protocol) as sock:
        return sock.request(kind, body, flags)
