"""The node daemon's netlink work that grows with services, flows or nodes, against the way it
was done before (pyroute2 decoding every message, every entry written again), measured in the
same run, each step in a namespace of its own.

- addresses: N addresses on a link named as IPVS mode's dummy (a bridge: some kernels, this
  machine's among them, have no dummy links), twenty other links with one each; the node's
  addresses split into the dummy's and the other links' (IPVS mode's one read per sync), read
  with struct, against pyroute2's `get_addr` of the family.
- UDP conntrack clean-up: N entries to a DNS service, half of them answered by an endpoint
  that is then gone; the clean-up of a change that leaves them all (both endpoints serve), of a
  change to a UDP service on another port, and of the change deleting the gone endpoint's half,
  against the same clean-up through pyroute2 (its dump filtered on the port by the kernel, its
  decoding, its deletes), as it was done before.
- overlay peers: node networking's apply of an unchanged picture of N nodes reached over VXLAN,
  against the same apply after the device's forwarding and neighbour entries were removed, so
  that it writes every peer's entries as every apply did before (the old apply also read them
  all first, which this anchor does not: it understates the old cost).

Each figure is the median of --rounds runs; a ratio above 1 is slower than the anchor.

Run as root from the repository root: .venv/bin/python -m bench.netlink_bench
[--addresses 10000] [--entries 10000] [--peers 500] [--rounds 5]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from pyroute2 import Conntrack, IPRoute
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

from bench import record
from cni.kernel.addresses import link_addresses
from deploy.lab.conntrack_entries import add_entry
from deploy.lab.netns import Netns, namespaces
from deploy.lab.process import exit_on_termination
from proxyd.conntrack import Frontends, clear_stale
from proxyd.ipvs import dummy, names
from proxyd.nodenet import kernel
from proxyd.nodenet.route_plan import NodeNet, check_peers, plan_routes
from proxyd.nodenet.routes import NTF_SELF, VXLAN_DEVICE, RouteTable

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


class Figures(list[dict[str, object]]):
    """The run's figures, each printed as it is measured."""

    def report(self, figure: str, value: float, anchor_name: str, anchor: float) -> None:
        print(
            f"{figure}: {value:.1f} ms | anchor {anchor_name} {anchor:.1f} ms"
            f" | {value / anchor:.2f}x"
        )
        self.append(
            {
                "figure": figure,
                "knit_ms": round(value, 2),
                "anchor": anchor_name,
                "anchor_ms": round(anchor, 2),
                "ratio": round(value / anchor, 2),
            }
        )


def host(index: int, network: str) -> str:
    return f"{network}.{index // 250}.{index % 250 + 1}"


def addresses(node: Netns, count: int, rounds: int, figures: Figures) -> None:
    node.run("ip", "link", "add", names.DUMMY, "type", "bridge")
    batch = [f"link set {names.DUMMY} up"]
    batch += [f"addr add {host(i, '10.96')}/32 dev {names.DUMMY}" for i in range(count)]
    for link in range(OTHER_LINKS):
        batch += [
            f"link add other{link} type bridge",
            f"addr add 10.10.{link}.1/24 dev other{link}",
        ]
    node.run("ip", "-batch", "-", stdin="\n".join(batch) + "\n")
    with node.entered(), IPRoute() as ipr:
        on_node = dummy.node_addresses(link_addresses(4))
        assert (len(on_node.bound), len(on_node.elsewhere)) == (count, OTHER_LINKS + 1)

        def pyroute2_read() -> None:
            ipr.get_addr(family=socket.AF_INET)

        anchor = median_ms(pyroute2_read, rounds)
        figures.report(
            f"the node's addresses split at the dummy, {count} on it",
            median_ms(lambda: dummy.node_addresses(link_addresses(4)), rounds),
            f"pyroute2's get_addr of {count + OTHER_LINKS + 1}",
            anchor,
        )


def add_entries(ct: Conntrack, indices: range) -> None:
    """UDP flows to DNS from a client per index, answered by ENDPOINT (odd) or GONE (even)."""
    for index in indices:
        reply_from = ENDPOINT if index % 2 else GONE
        add_entry(ct, socket.AF_INET, host(index, "10.1"), DNS, reply_from[0])


def pyroute2_clean(ct: Conntrack, frontends: Frontends) -> int:
    """The clean-up as it was before it read the entries with struct: pyroute2 dumps each
    frontend port's UDP entries (the kernel filters), decodes them, and deletes the stale ones."""
    stale = [
        entry
        for port in sorted({port for _, port in frontends.by_address})
        for entry in ct.dump_entries(tuple_orig=NFCTAttrTuple(**UDP, dport=port))
        if frontends.stale(
            (entry.tuple_orig.daddr, entry.tuple_orig.dport),
            (entry.tuple_reply.saddr, entry.tuple_reply.sport),
        )
    ]
    for entry in stale:
        ct.delete(entry)
    return len(stale)


def conntrack(node: Netns, count: int, rounds: int, figures: Figures) -> None:
    both = Frontends(4, by_address={DNS: {ENDPOINT, GONE}})
    other = Frontends(4, by_address={("10.96.0.11", 5353): {ENDPOINT}})
    one = Frontends(4, by_address={DNS: {ENDPOINT}})
    with node.entered(), Conntrack() as ct:
        began = time.monotonic()
        add_entries(ct, range(count))
        print(f"made {count} UDP entries through pyroute2 in {time.monotonic() - began:.1f} s")
        for figure, frontends in (
            (f"clean-up of the DNS service, none of its {count} entries stale", both),
            (f"clean-up of a UDP service on another port, beside the {count}", other),
        ):
            figures.report(
                figure,
                median_ms(partial(clear_stale, frontends), rounds),
                "pyroute2's",
                median_ms(partial(pyroute2_clean, ct, frontends), rounds),
            )
        took: dict[str, list[float]] = {"knit": [], "pyroute2": []}
        gone = range(0, count, 2)
        for _ in range(rounds):
            for name, clean in (("knit", clear_stale), ("pyroute2", partial(pyroute2_clean, ct))):
                began = time.monotonic()
                deleted = clean(one)
                took[name].append(time.monotonic() - began)
                assert deleted == len(gone)
                add_entries(ct, gone)
        figures.report(
            f"clean-up of the DNS service deleting {len(gone)} of its {count} entries",
            statistics.median(took["knit"]) * 1000,
            "pyroute2's",
            statistics.median(took["pyroute2"]) * 1000,
        )


def overlay_peers(node: Netns, count: int, rounds: int, figures: Figures) -> None:
    local = NodeNet("local", ("10.244.0.0/24",), ("10.77.1.11",))
    peers = [
        NodeNet(f"peer{i}", (f"10.{100 + i // 250}.{i % 250}.0/24",), (host(i, "10.78"),))
        for i in range(count)
    ]
    batch = ["link add eth0 type veth peer name segment"]
    batch += ["addr add 10.77.1.11/24 dev eth0", "link set eth0 up", "link set segment up"]
    node.run("ip", "-batch", "-", stdin="\n".join(batch) + "\n")
    # the peers' CIDRs (10.100-10.101.x.0/24) inside a cluster CIDR, as a real cluster's are
    checked = check_peers(local, peers, ("10.96.0.0/11",), ("10.77.1.11/24",))
    plan = plan_routes(local, checked, "auto", lambda _: False)
    with node.entered(), IPRoute() as ipr, kernel.route_socket() as sock:
        table = RouteTable(sock)
        table.apply(local, plan, 1450)

        def apply_after_flush() -> float:
            """Seconds of an apply that writes every peer's entries (as every apply did, though
            that also read them all first)."""
            index = ipr.link_lookup(ifname=VXLAN_DEVICE)[0]
            node.run("ip", "neigh", "flush", "dev", VXLAN_DEVICE, "nud", "permanent")
            for entry in ipr.fdb("dump", ifindex=index):
                dst = entry.get("NDA_DST")
                if dst:
                    ipr.fdb(
                        "del",
                        ifindex=index,
                        lladdr=entry.get("NDA_LLADDR"),
                        dst=dst,
                        flags=NTF_SELF,
                    )
            began = time.monotonic()
            table.apply(local, plan, 1450)
            return time.monotonic() - began

        figures.report(
            f"node networking's apply of {count} VXLAN peers, unchanged",
            median_ms(lambda: table.apply(local, plan, 1450), rounds),
            "the same apply writing every peer's entries",
            statistics.median(apply_after_flush() for _ in range(rounds)) * 1000,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--addresses", type=int, default=10000)
    parser.add_argument("--entries", type=int, default=10000)
    parser.add_argument("--peers", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    record.add_json_option(parser)
    options = parser.parse_args()
    began_at = record.revision()
    exit_on_termination()
    figures = Figures()
    steps = (
        (addresses, options.addresses),
        (conntrack, options.entries),
        (overlay_peers, options.peers),
    )
    with namespaces("knb-") as make_netns:
        for step, count in steps:
            step(make_netns("node"), count, options.rounds, figures)
    defaults = (10000, 10000, 500, 5)
    chosen = (options.addresses, options.entries, options.peers, options.rounds)
    variant = "" if chosen == defaults else "-".join(map(str, chosen))
    record.write(record.result_path(options.json, "netlink", variant), figures, began_at)


if __name__ == "__main__":
    main()
