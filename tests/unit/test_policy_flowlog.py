"""What the pod chains hand to NFLOG: the prefix naming the chain, rule and verdict, the
packets read back, and what NFLOG's numbering says was lost."""

from __future__ import annotations

import ipaddress
import struct
from collections.abc import Iterator
from typing import cast

from cni.kernel.rawnetlink import NFGENMSG, NetlinkSocket, attribute
from proxyd.policy.compile import ALLOW, DROP
from proxyd.policy.flowlog import (
    GROUP,
    PACKET_MESSAGE,
    PAYLOAD,
    PREFIX,
    SEQUENCE,
    FlowLog,
    Logged,
    Logging,
    Sequence,
    logging_for,
    parse,
    prefix,
)


def ipv4(protocol: int, source: str, destination: str, ports: bytes) -> bytes:
    header = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(ports), 0, 0, 64, protocol, 0,
        ipaddress.IPv4Address(source).packed, ipaddress.IPv4Address(destination).packed,
    )  # fmt: skip
    return header + ports


def test_a_prefix_names_the_chain_the_rule_or_the_end_and_the_verdict() -> None:
    assert prefix("ingress-ABC-next", 3, ALLOW) == "ingress-ABC-next 3 allow"
    assert prefix("egress-ABC", None, DROP) == "egress-ABC end drop"
    longest = prefix("ingress-" + "A" * 16 + "-next", 65535, DROP)
    assert len(longest) < 128, "nft's log prefix holds 127 bytes"


def test_a_tcp_syn_is_read_with_its_ports_and_where_its_verdict_came_from() -> None:
    packet = ipv4(6, "10.244.3.5", "10.244.1.4", struct.pack("!HH", 40000, 80) + bytes(16))
    assert parse("ingress-X 2 allow", packet, 5.0) == Logged(
        "ingress-X", 2, ALLOW, "tcp", "10.244.3.5", 40000, "10.244.1.4", 80, 5.0
    )
    logged = parse("ingress-X end drop", packet, 5.0)
    assert logged is not None and logged.index is None and logged.verdict == DROP


def test_ipv6_udp_and_a_protocol_without_ports() -> None:
    header = struct.pack(
        "!IHBB16s16s", 6 << 28, 8, 17, 64,
        ipaddress.IPv6Address("fd00::1").packed, ipaddress.IPv6Address("fd00::2").packed,
    )  # fmt: skip
    udp = parse("egress-Y 0 allow", header + struct.pack("!HHHH", 5000, 53, 8, 0), 1.0)
    assert udp == Logged("egress-Y", 0, ALLOW, "udp", "fd00::1", 5000, "fd00::2", 53, 1.0)
    icmp = parse("ingress-X end drop", ipv4(1, "10.0.0.1", "10.0.0.2", bytes(8)), 1.0)
    assert icmp == Logged("ingress-X", None, DROP, "1", "10.0.0.1", None, "10.0.0.2", None, 1.0)


def test_what_cannot_be_read_is_none() -> None:
    packet = ipv4(6, "10.0.0.1", "10.0.0.2", bytes(20))
    assert parse("ingress-X 1 allow", b"", 0) is None
    assert parse("ingress-X 1 allow", bytes([0x45]) + bytes(10), 0) is None
    for text in ("ingress-X", "ingress-X one allow", "ingress-X 1 allow extra", ""):
        assert parse(text, packet, 0) is None, text


def test_records_log_every_verdict_and_the_denial_log_alone_only_drops() -> None:
    assert logging_for(0, 0) is None
    assert logging_for(0, 5) == Logging(5, frozenset({DROP}))
    assert logging_for(100, 5) == Logging(100, frozenset({ALLOW, DROP}))


def test_gaps_in_the_numbering_are_lost_records_and_it_wraps() -> None:
    sequence = Sequence()
    for number in (7, 8, 11, 12):
        sequence.saw(number)
    assert sequence.lost == 2
    sequence.saw(10)  # reordered, not lost
    assert sequence.lost == 2
    wrapping = Sequence()
    wrapping.saw((1 << 32) - 2)
    wrapping.saw(1)
    assert wrapping.lost == 2, "the last number and 0"


class FakeSocket:
    """Hands over NFLOG packet messages as the kernel's netlink socket would."""

    def __init__(self, *messages: bytes) -> None:
        self._messages = messages

    def messages(self) -> Iterator[tuple[int, memoryview]]:
        for message in self._messages:
            yield PACKET_MESSAGE, memoryview(message)


def message(text: str, number: int) -> bytes:
    packet = ipv4(6, "10.0.0.1", "10.0.0.2", struct.pack("!HH", 40000, 80) + bytes(16))
    return (
        NFGENMSG.pack(0, 0, GROUP)
        + attribute(PREFIX, text.encode() + b"\0")
        + attribute(PAYLOAD, packet)
        + attribute(SEQUENCE, struct.pack("!I", number))
    )


def test_a_record_that_fails_costs_only_itself_and_gaps_count_as_lost() -> None:
    reported: list[Logged] = []

    def report(logged: Logged) -> None:
        if logged.index == 0:
            raise KeyError("a bug in resolving one record")
        reported.append(logged)

    flow_log = FlowLog(report)
    sock = FakeSocket(message("ingress-X 0 allow", 1), message("ingress-X 1 allow", 4))
    flow_log._read(cast(NetlinkSocket, sock))
    assert [r.index for r in reported] == [1]
    assert flow_log.lost == 2
