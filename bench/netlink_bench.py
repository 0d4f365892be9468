"""The node daemon's two reads that return one netlink message per service or flow, against
pyroute2 reading the same dumps in the same run, in a namespace of its own.

- addresses: N addresses on a link named as IPVS mode's dummy (a bridge: some kernels, this
  machine's among them, have no dummy links), twenty other links with one each; the node's
  addresses but the dummy's (IPVS mode, every sync) and the dummy's own (its full sync),
  against pyroute2's `get_addr` of the family.
- UDP conntrack clean-up: N entries to a DNS service, half of them answered by an endpoint
  that is then gone; the clean-up of a change that leaves them all (both endpoints serve),
  of a change to a UDP service on another port, and of the change deleting the gone endpoint's
  half, against pyroute2 reading the same port's entries (`dump_entries`, filtered on the port
  by the kernel), which is what the clean-up did before it read them with struct.

Each figure is the median of --rounds runs; a ratio above 1 is slower than pyroute2's read.

Run as root from the repository root: .venv/bin/python -m bench.netlink_bench
[--addresses 10000] [--entries 10000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from typing import Any

from pyroute2 import Conntrack, IPRoute
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

from proxyd.addresses import local_addresses
from proxyd.conntrack import UdpFrontends, clear_stale
from proxyd.ipvs import dummy, names
from tests.conftest import Netns, unique_name

OTHER_LINKS = 20
DNS = ("10.96.0.10", 53)
ENDPOINT, GONE = ("10.244.1.5", 53), ("10.244.1.6", 53)
UDP = {"family": socket.AF_INET, "proto": socket.IPPROTO_UDP}


def median_ms(fn: Callable[[], Any], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        began = time.monotonic()
        fn()
        times.append(time.monotonic() - began)
    return statistics.median(times) * 1000


def report(figure: str, value: float, anchor_name: str, anchor: float) -> None:
    print(
        f"{figure}: {value:.1f} ms | anchor {anchor_name} {anchor:.1f} ms | {value / anchor:.2f}x"
    )


def host(index: int, network: str) -> str:
    return f"{network}.{index // 250}.{index % 250 + 1}"


def addresses(node: Netns, count: int, rounds: int) -> None:
    node.run("ip", "link", "add", names.DUMMY, "type", "bridge")
    batch = ["link set lo up", f"link set {names.DUMMY} up"]
    batch += [f"addr add {host(i, '10.96')}/32 dev {names.DUMMY}" for i in range(count)]
    for link in range(OTHER_LINKS):
        batch += [
            f"link add other{link} type bridge",
            f"addr add 10.10.{link}.1/24 dev other{link}",
        ]
    node.run("ip", "-batch", "-", stdin="\n".join(batch) + "\n")
    with node.entered(), IPRoute() as ipr:
        assert len(dummy.addresses(4)) == count
        assert len(local_addresses(4, names.DUMMY)) == OTHER_LINKS + 1

        def pyroute2_read() -> None:
            ipr.get_addr(family=socket.AF_INET)

        anchor = median_ms(pyroute2_read, rounds)
        name = f"pyroute2's get_addr of {count + OTHER_LINKS + 1}"
        report(
            f"the node's addresses but the dummy's, beside {count} on it",
            median_ms(lambda: local_addresses(4, names.DUMMY), rounds),
            name,
            anchor,
        )
        report(
            f"the dummy's {count} addresses",
            median_ms(lambda: dummy.addresses(4), rounds),
            name,
            anchor,
        )


def add_entries(ct: Conntrack, indices: range) -> None:
    """UDP flows to DNS from a client per index, answered by ENDPOINT (odd) or GONE (even)."""
    for index in indices:
        client = host(index, "10.1")
        reply = ENDPOINT if index % 2 else GONE
        ct.entry(
            "add",
            tuple_orig=NFCTAttrTuple(**UDP, saddr=client, daddr=DNS[0], sport=40000, dport=53),
            tuple_reply=NFCTAttrTuple(**UDP, saddr=reply[0], daddr=client, sport=53, dport=40000),
            timeout=600,
        )


def conntrack(node: Netns, count: int, rounds: int) -> None:
    both = UdpFrontends(4, by_address={DNS: {ENDPOINT, GONE}})
    other = UdpFrontends(4, by_address={("10.96.0.11", 5353): {ENDPOINT}})
    one = UdpFrontends(4, by_address={DNS: {ENDPOINT}})
    with node.entered(), Conntrack() as ct:
        began = time.monotonic()
        add_entries(ct, range(count))
        print(f"made {count} UDP entries through pyroute2 in {time.monotonic() - began:.1f} s")

        def pyroute2_read() -> None:
            for _ in ct.dump_entries(tuple_orig=NFCTAttrTuple(**UDP, dport=53)):
                pass

        anchor = median_ms(pyroute2_read, rounds)
        name = f"pyroute2 reading the {count} entries of port 53"
        for figure, frontends in (
            (f"clean-up of the DNS service, none of its {count} entries stale", both),
            ("clean-up of a UDP service on another port", other),
        ):
            report(figure, median_ms(lambda f=frontends: clear_stale(f), rounds), name, anchor)
        deletes = []
        for _ in range(rounds):
            began = time.monotonic()
            deleted = clear_stale(one)
            deletes.append(time.monotonic() - began)
            assert deleted == count // 2
            add_entries(ct, range(0, count, 2))  # GONE's half again
        figure = f"clean-up of the DNS service deleting {count // 2} of its {count} entries"
        report(figure, statistics.median(deletes) * 1000, name, anchor)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addresses", type=int, default=10000)
    parser.add_argument("--entries", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    for step in (addresses, conntrack):
        node = Netns(unique_name("knb"))
        subprocess.run(["ip", "netns", "add", node.name], check=True)
        try:
            count = options.addresses if step is addresses else options.entries
            step(node, count, options.rounds)
        finally:
            node.remove()


if __name__ == "__main__":
    main()
