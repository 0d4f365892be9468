"""Conntrack entries made through pyroute2 (another reading of ctnetlink than knit's clean-up), for
the clean-up's kernel tests and its bench."""

from __future__ import annotations

import socket

from pyroute2 import Conntrack
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

ANSWERED = (1 << 1) | (1 << 3)
"""The status of an entry that has seen a reply: SEEN_REPLY, with CONFIRMED, which the kernel
sets on every entry it holds (a status that differs from the entry's in it is refused)."""


def add_entry(
    ct: Conntrack,
    family: int,
    client: str,
    destination: tuple[str, int],
    reply_from: str,
    zone: int = 0,
    proto: int = socket.IPPROTO_UDP,
    reply_port: int = 53,
    answered: bool = False,
) -> None:
    """A flow (UDP unless told) from client:40000 to destination whose replies come from
    reply_from:reply_port; `answered`: one has come (the entry's status says so)."""
    udp = {"family": family, "proto": proto}
    ct.entry(
        "add",
        zone=zone,
        tuple_orig=NFCTAttrTuple(
            **udp, saddr=client, daddr=destination[0], sport=40000, dport=destination[1]
        ),
        tuple_reply=NFCTAttrTuple(
            **udp, saddr=reply_from, daddr=client, sport=reply_port, dport=40000
        ),
        timeout=300,
        **({"status": ANSWERED} if answered else {}),
    )
