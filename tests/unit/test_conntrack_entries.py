"""The clean-up's reading of a conntrack dump, the kernel's side scripted: whole UDP entries
are read (original destination, reply source) and named for deletion by their original tuple,
id and zone; entries of another protocol, or whose address or port has the wrong length, are
skipped rather than failing the clean-up."""

from __future__ import annotations

import socket

from cni.kernel.rawnetlink import DONE, NFGENMSG, attribute
from proxyd import conntrack
from proxyd.conntrack import (
    CTA_ID,
    CTA_TUPLE_IP,
    CTA_TUPLE_ORIG,
    CTA_TUPLE_PROTO,
    CTA_TUPLE_REPLY,
    CTA_ZONE,
    MSG_NEW,
    PORT,
)
from tests.support.netlink_script import ScriptedKernel, message, scripted

ID, ZONE = b"\x00\x00\x00\x2a", b"\x00\x07"


def udp_tuple(
    kind: int, source: str, destination: str | bytes, port: bytes, proto: int = 17
) -> bytes:
    """A tuple attribute from source:40000 to destination:port (bytes given as they are)."""
    to = destination if isinstance(destination, bytes) else socket.inet_aton(destination)
    ip = attribute(1, socket.inet_aton(source)) + attribute(2, to)
    ports = attribute(2, PORT.pack(40000)) + attribute(3, port)
    proto_attributes = attribute(1, bytes([proto])) + ports
    inner = attribute(CTA_TUPLE_IP, ip, nested=True)
    inner += attribute(CTA_TUPLE_PROTO, proto_attributes, nested=True)
    return attribute(kind, inner, nested=True)


def entry(destination: str | bytes, port: bytes = PORT.pack(53), proto: int = 17) -> bytes:
    """A conntrack entry from 10.1.0.1 to destination, answered by 10.244.1.6."""
    orig = udp_tuple(CTA_TUPLE_ORIG, "10.1.0.1", destination, port, proto)
    reply = udp_tuple(CTA_TUPLE_REPLY, "10.244.1.6", "10.1.0.1", PORT.pack(40000), proto)
    identity = attribute(CTA_ID, ID) + attribute(CTA_ZONE, ZONE)
    return NFGENMSG.pack(socket.AF_INET, 0, 0) + orig + reply + identity


def test_whole_udp_entries_are_read_and_the_rest_skipped() -> None:
    whole = entry("10.96.0.10")
    dump = [
        entry("10.96.0.11", port=b"\x35"),  # a one-byte port
        entry("10.96.0.12", proto=socket.IPPROTO_TCP),
        whole,
        entry("10.96.0.13")[:-16] + attribute(CTA_ZONE, ZONE),  # whole, without its id
    ]
    three_byte_address = entry(b"\x0a\x60\x00")

    def script(seq: int) -> list[bytes]:
        messages = [message(MSG_NEW, seq, payload) for payload in [*dump, three_byte_address]]
        return [b"".join(messages) + message(DONE, seq)]

    kept = conntrack.entries(scripted(ScriptedKernel(script)), socket.AF_INET, 53, lambda *_: True)
    assert [(e.destination, e.reply_source) for e in kept] == [
        (("10.96.0.10", 53), ("10.244.1.6", 40000)),
        (("10.96.0.13", 53), ("10.244.1.6", 40000)),
    ]
    orig = udp_tuple(CTA_TUPLE_ORIG, "10.1.0.1", "10.96.0.10", PORT.pack(53))
    header = NFGENMSG.pack(socket.AF_INET, 0, 0)
    identity = attribute(CTA_ID, ID) + attribute(CTA_ZONE, ZONE)
    assert kept[0].delete_request == header + orig + identity
    assert kept[1].delete_request.endswith(attribute(CTA_ZONE, ZONE))
    assert attribute(CTA_ID, ID) not in kept[1].delete_request
