"""Netlink as rawnetlink writes and reads it: attributes padded to four bytes, nested ones
flagged, read back by type with the flags left out; replies to a dump or a request read across
buffers to their end, an error, an interrupted dump or a malformed message (the kernel's side
scripted: the kernel tests read real dumps)."""

from __future__ import annotations

import errno
import socket

import pytest

from cni.kernel.rawnetlink import (
    DONE,
    DUMP_ATTEMPTS,
    DUMP_INTERRUPTED,
    ERROR_CODE,
    NESTED,
    SO_RCVBUFFORCE,
    RawNetlinkError,
    attribute,
    attributes,
)
from tests.support.netlink_script import ScriptedKernel, error, message, scripted


def test_an_attribute_is_padded_to_four_bytes() -> None:
    assert attribute(3, b"\x11") == b"\x05\x00\x03\x00\x11\x00\x00\x00"
    assert attribute(1, b"abcd") == b"\x08\x00\x01\x00abcd"


def test_nested_attributes_are_flagged_and_read_back_by_type() -> None:
    inner = attribute(1, b"\x11") + attribute(3, b"\x00\x35")
    outer = attribute(2, inner, nested=True) + attribute(12, b"\x00\x00\x00\x07")
    assert outer[2:4] == (2 | NESTED).to_bytes(2, "little")
    found = attributes(memoryview(outer))
    assert set(found) == {2, 12}
    assert bytes(found[12]) == b"\x00\x00\x00\x07"
    nested = attributes(found[2])
    assert bytes(nested[1]) == b"\x11" and bytes(nested[3]) == b"\x00\x35"


def test_a_truncated_run_stops_at_the_last_whole_attribute() -> None:
    for tail in (b"\x02\x00", b"\x08\x00\x02\x00ab"):
        assert list(attributes(memoryview(attribute(1, b"abcd") + tail))) == [1]


def payloads(kind: int, payload: memoryview) -> bytes:
    return bytes(payload)


def test_a_dump_spans_reads_and_skips_replies_to_other_requests() -> None:
    kernel = ScriptedKernel(
        lambda seq: [
            message(20, seq, b"one") + message(20, seq + 7, b"stale") + message(20, seq, b"two"),
            message(20, seq, b"three") + message(DONE, seq, ERROR_CODE.pack(0)),
        ]
    )
    assert scripted(kernel).dump(22, b"", payloads) == [b"one", b"two", b"three"]


def test_a_dump_failing_part_way_raises_the_kernels_code() -> None:
    kernel = ScriptedKernel(
        lambda seq: [message(20, seq, b"one") + message(DONE, seq, ERROR_CODE.pack(-22))]
    )
    with pytest.raises(RawNetlinkError) as failed:
        scripted(kernel).dump(22, b"", payloads)
    assert failed.value.errno == errno.EINVAL


def test_an_interrupted_dump_is_asked_again_until_whole_or_out_of_attempts() -> None:
    def interrupted(seq: int) -> list[bytes]:
        return [message(20, seq, b"old", DUMP_INTERRUPTED) + message(DONE, seq)]

    def whole(seq: int) -> list[bytes]:
        return [message(20, seq, b"new") + message(DONE, seq)]

    def interrupted_at_its_end(seq: int) -> list[bytes]:
        return [message(20, seq, b"old") + message(DONE, seq, flags=DUMP_INTERRUPTED)]

    kernel = ScriptedKernel(interrupted, interrupted_at_its_end, whole)
    assert scripted(kernel).dump(22, b"", payloads) == [b"new"]
    assert kernel.requests == 3
    kernel = ScriptedKernel(*[interrupted] * DUMP_ATTEMPTS)
    with pytest.raises(RawNetlinkError) as failed:
        scripted(kernel).dump(22, b"", payloads)
    assert failed.value.errno == errno.EINTR


def test_a_request_ends_at_its_acknowledgement_or_raises_its_refusal() -> None:
    kernel = ScriptedKernel(
        lambda seq: [message(0x105, seq, b"stat") + error(seq, 0)],
        lambda seq: [error(seq, -errno.ENOENT)],
    )
    sock = scripted(kernel)
    assert [(kind, bytes(payload)) for kind, payload in sock.request(0x105, b"")] == [
        (0x105, b"stat")
    ]
    with pytest.raises(RawNetlinkError) as refused:
        sock.request(0x102, b"")
    assert refused.value.errno == errno.ENOENT


def test_a_message_longer_than_its_buffer_is_malformed() -> None:
    kernel = ScriptedKernel(lambda seq: [message(20, seq, b"whole")[:-4]])
    with pytest.raises(RawNetlinkError) as malformed:
        scripted(kernel).dump(22, b"", payloads)
    assert malformed.value.errno == errno.EPROTO


class Unprivileged(ScriptedKernel):
    """A kernel refusing SO_RCVBUFFORCE, as it does a process without CAP_NET_ADMIN."""

    def setsockopt(self, level: int, option: int, value: int) -> None:
        if option == SO_RCVBUFFORCE:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        super().setsockopt(level, option, value)


def test_a_receive_buffer_is_forced_past_the_limit_where_the_process_may() -> None:
    kernel, unprivileged = ScriptedKernel(), Unprivileged()
    scripted(kernel).receive_buffer(1 << 22)
    scripted(unprivileged).receive_buffer(1 << 22)
    assert kernel.options == [(socket.SOL_SOCKET, SO_RCVBUFFORCE, 1 << 22)]
    assert unprivileged.options == [(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)]
