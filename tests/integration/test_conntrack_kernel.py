"""The UDP conntrack clean-up against the kernel's table, in a namespace of its own: entries made
through netlink, then cleared with a dump per frontend (the kernel filters) and with one dump of
every UDP entry (past FILTERED_DUMPS_UP_TO frontends); both delete the same, stale, entries."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from pyroute2 import Conntrack
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

from proxyd import conntrack
from proxyd.conntrack import UdpFrontends, clear_stale
from tests.conftest import Netns

CLUSTER_IP, NODE_IP, ELSEWHERE = "10.96.0.10", "10.77.1.11", "10.77.1.99"
ENDPOINT, GONE = "10.244.1.5", "10.244.1.6"
NODE_PORT = 30053


def add_entry(ct: Conntrack, client: str, destination: tuple[str, int], reply_from: str) -> None:
    """A UDP flow from client:40000 to destination whose replies come from reply_from:53."""
    udp = {"family": socket.AF_INET, "proto": socket.IPPROTO_UDP}
    ct.entry(
        "add",
        tuple_orig=NFCTAttrTuple(
            **udp, saddr=client, daddr=destination[0], sport=40000, dport=destination[1]
        ),
        tuple_reply=NFCTAttrTuple(**udp, saddr=reply_from, daddr=client, sport=53, dport=40000),
        timeout=300,
    )


def remaining(ct: Conntrack) -> set[tuple[str, str, int]]:
    """(client, destination address, port) of every UDP entry left."""
    udp = NFCTAttrTuple(family=socket.AF_INET, proto=socket.IPPROTO_UDP)
    return {
        (e.tuple_orig.saddr, e.tuple_orig.daddr, e.tuple_orig.dport)
        for e in ct.dump_entries(tuple_orig=udp)
    }


@pytest.mark.parametrize("filtered", [True, False], ids=["dump-per-frontend", "one-dump"])
def test_stale_udp_entries_of_the_frontends_go_and_the_rest_stay(
    make_netns: Callable[[str], Netns], monkeypatch: pytest.MonkeyPatch, filtered: bool
) -> None:
    if not filtered:
        monkeypatch.setattr(conntrack, "FILTERED_DUMPS_UP_TO", 0)
    node = make_netns("conntrack")
    frontends = UdpFrontends(
        4,
        by_address={(CLUSTER_IP, 53): {(ENDPOINT, 53)}},
        by_node_port={NODE_PORT: {(ENDPOINT, 53)}},
        local_addresses={NODE_IP},
    )
    assert len(frontends.dump_filters()) == (2 if filtered else 1)
    with node.entered(), Conntrack() as ct:
        add_entry(ct, "10.1.0.1", (CLUSTER_IP, 53), ENDPOINT)
        add_entry(ct, "10.1.0.2", (CLUSTER_IP, 53), GONE)
        add_entry(ct, "10.1.0.3", (CLUSTER_IP, 5353), GONE)
        add_entry(ct, "10.1.0.4", (NODE_IP, NODE_PORT), GONE)
        add_entry(ct, "10.1.0.5", (ELSEWHERE, NODE_PORT), GONE)
        add_entry(ct, "10.1.0.6", (NODE_IP, NODE_PORT), ENDPOINT)
        assert clear_stale(frontends) == 2
        assert remaining(ct) == {
            ("10.1.0.1", CLUSTER_IP, 53),
            ("10.1.0.3", CLUSTER_IP, 5353),
            ("10.1.0.5", ELSEWHERE, NODE_PORT),
            ("10.1.0.6", NODE_IP, NODE_PORT),
        }
