"""Reading the packets NFLOG hands over for denied connections."""

from __future__ import annotations

import ipaddress
import struct

from proxyd.policy.denials import Denied, parse_packet


def ipv4(protocol: int, source: str, destination: str, ports: bytes) -> bytes:
    header = struct.pack(
        "!BBHHHBBH4s4s", 0x45, 0, 20 + len(ports), 0, 0, 64, protocol, 0,
        ipaddress.IPv4Address(source).packed, ipaddress.IPv4Address(destination).packed,
    )  # fmt: skip
    return header + ports


def test_a_tcp_syn_names_its_addresses_and_destination_port() -> None:
    packet = ipv4(6, "10.244.3.5", "10.244.1.4", struct.pack("!HH", 40000, 80) + bytes(16))
    assert parse_packet("ingress-X", packet) == Denied(
        "ingress-X", "tcp", "10.244.3.5", "10.244.1.4", 80
    )


def test_ipv6_udp_and_a_protocol_without_ports() -> None:
    header = struct.pack(
        "!IHBB16s16s", 6 << 28, 8, 17, 64,
        ipaddress.IPv6Address("fd00::1").packed, ipaddress.IPv6Address("fd00::2").packed,
    )  # fmt: skip
    assert parse_packet("egress-Y", header + struct.pack("!HHHH", 5000, 53, 8, 0)) == Denied(
        "egress-Y", "udp", "fd00::1", "fd00::2", 53
    )
    icmp = ipv4(1, "10.0.0.1", "10.0.0.2", bytes(8))
    assert parse_packet("ingress-X", icmp) == Denied("ingress-X", "1", "10.0.0.1", "10.0.0.2", None)


def test_a_packet_too_short_to_read_is_none() -> None:
    assert parse_packet("ingress-X", b"") is None
    assert parse_packet("ingress-X", bytes([0x45]) + bytes(10)) is None
