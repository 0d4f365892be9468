"""The kernel's side of a netlink socket, scripted, for unit tests of rawnetlink's readers."""

from __future__ import annotations

from collections.abc import Callable
from itertools import count

from cni.kernel.rawnetlink import ERROR, ERROR_CODE, HEADER, NetlinkSocket, align


def message(kind: int, sequence: int, payload: bytes = b"", flags: int = 0) -> bytes:
    length = HEADER.size + len(payload)
    return HEADER.pack(length, kind, flags, sequence, 0) + payload + bytes(align(length) - length)


def error(sequence: int, code: int) -> bytes:
    return message(ERROR, sequence, ERROR_CODE.pack(code) + bytes(HEADER.size))


class ScriptedKernel:
    """Stands in for the kernel's end of a netlink socket: each request sent is answered with
    the buffers its script makes of the request's sequence number, one per recv; the requests
    and the socket options set are kept."""

    def __init__(self, *scripts: Callable[[int], list[bytes]]) -> None:
        self.scripts = list(scripts)
        self.buffers: list[bytes] = []
        self.requests = 0
        self.sent: list[bytes] = []
        self.options: list[tuple[int, int, int]] = []

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self.options.append((level, option, value))

    def send(self, data: bytes) -> int:
        self.requests += 1
        self.sent.append(data)
        _, _, _, sequence, _ = HEADER.unpack_from(data)
        self.buffers.extend(self.scripts.pop(0)(sequence))
        return len(data)

    def recv(self, _: int) -> bytes:
        return self.buffers.pop(0)

    def close(self) -> None:
        pass


def scripted(kernel: ScriptedKernel) -> NetlinkSocket:
    sock = NetlinkSocket.__new__(NetlinkSocket)
    sock._socket = kernel  # type: ignore[assignment]
    sock._sequence = count(1)
    return sock
