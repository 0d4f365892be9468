"""Conntrack entries made through pyroute2 (another reading of ctnetlink than knit's clean-up), for
the clean-up's kernel tests and its bench."""

from __future__ import annotations

import socket

from pyroute2 import Conntrack
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple


def add_entry(
    ct: Conntrack,
    family: int,
    client: str,
    destination: tuple[str, int],
    reply_from: str,
    zone: int = 0,
    proto: int = socket.IPPROTO_UDP,
) -> None:
    """A flow (UDP unless told) from client:40000 to destination whose replies come from
    reply_from:53."""
    udp = {"family": family, "proto": proto}
    ct.entry(
        "add",
        zone=zone,
        tuple_orig=NFCTAttrTuple(
            **udp, saddr=client, daddr=destination[0], sport=40000, dport=destination[1]
        ),
        tuple_reply=NFCTAttrTuple(**udp, saddr=reply_from, daddr=client, sport=53, dport=40000),
        timeout=300,
    )
