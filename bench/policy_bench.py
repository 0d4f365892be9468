"""knit-proxyd's NetworkPolicy at scale, each figure beside an anchor measured in the same run.

A real etcd + kube-apiserver on host loopback; one node namespace running knit-proxyd (the
tests' flags), with three real pods attached by libcni: a client, a server that policies
select and a server no policy selects. Around them, simulated pods (Pod objects with
addresses, on other nodes) in 100 namespaces, and policies selecting pods by label with
peers by namespace and pod selectors and ports by number and name, some of them selecting
the local server. The pods are created in steps (--pods, default 1,000 then 10,000) and at
each step it measures:

- the time from a pod's label change in the API to its address being in (or out of) a peer
  set in the kernel, and from a policy's creation (or deletion) to its set being in (or out
  of) the table: PATCH/POST/DELETE returned to a poll from a thread in the node namespace
  seeing it (a libnftables `get element` or the table's set names, each well under 1 ms);
- at the last step: the policy's full sync at the daemon's start (the time its log line
  gives: compile and transaction, the loading's share and the sync thread's CPU time; the
  median of seven starts) against a bare `nft -f` of exactly the tables it wrote, into a fresh
  namespace; the daemon's resident memory with policy
  enforcement on against off, for the same objects; and TCP connections per second
  (sequential connect + reset) from the client to the selected server against the server no
  policy selects, alternating, paired;
- at the last step: the time from a label change that takes a client out of the peer set
  allowing it to the client's open connection being cut (an echo going unanswered), against
  the time the same change takes to reach the peer set in the kernel; with the node's
  conntrack table holding only that connection, and holding CONNTRACK_LOAD more entries
  (UDP flows to a pod no policy selects, which the cut reads and keeps);
- at the last step: the cost of flow records, TCP connections per second from the client to
  the selected server (which the policies isolate and whose ingress allows the client) with
  the daemon restarted with records off (the anchor), at the recommended rate and at a rate
  above any the client reaches (every connection recorded), taking turns over FLOW_CYCLES
  cycles, each round beside one to the server no policy selects (the machine's other load
  meanwhile); with each, the records written, the records lost over the limit and in the
  daemon's socket buffer (its metrics) and the daemon's CPU (its /proc stat).

Every figure goes, with its command, commit and machine, into docs/results/<date>-policy.json
(or the file `--json` names).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from bench import record
from bench.proxy_connections import CLIENT_LOOP, SERVER
from bench.proxy_netns import in_netns
from cni.kernel.nftables import NftError
from deploy.lab.cluster import Cluster, LabNode, LabPod
from deploy.lab.controlplane import ControlPlane, start
from deploy.lab.held import HeldConnection
from deploy.lab.kube import Kube, pod_object
from deploy.lab.netns import Netns, unique_name
from deploy.lab.paths import PLUGIN_DIR
from deploy.lab.process import eventually, exit_on_termination, in_ns
from proxyd.nftables.kernel import Nft
from proxyd.policy.flowlog import FLUSH_TIMEOUT
from proxyd.policy.render import TABLE

NAMESPACES = 100
SIZES = (1_000, 10_000)
POLICIES = 1_000
SAMPLES = 20
CONNECTION_PORT = 8080
LATENCY_GOAL = 0.020
FULL_SYNC_GOAL = 1.5
CONNECTION_GOAL = 0.95
CONNECTION_SECONDS = 2.0
SELECTED_NAMESPACE = "bench-0"
T = TypeVar("T")
FIRST_SYNC = re.compile(
    r"policy sync: \d+ policies, \d+ cluster policies, \d+ pods in ([\d.]+) ms "
    r"\(([\d.]+) ms of it loading nft; ([\d.]+) ms of CPU\)"
)
"""The daemon's log line of each policy sync."""
STARTS = 7
"""Daemon starts whose first policy sync is timed (the median is reported)."""
CUT_SAMPLES = 10
CONNTRACK_LOAD = 50_000
CUT_GOAL = 1.0
UDP_FLOWS = """
import socket, sys
host, count = sys.argv[1], int(sys.argv[2])
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
    for index in range(count):
        sock.sendto(b"x", (host, 1024 + index % 60000))
"""
"""UDP datagrams to `count` ports of a host: as many conntrack entries on the node."""
METRICS = "http://127.0.0.1:10249/metrics"
"""The lab daemon's metrics, from its node namespace."""
FLOW_RATE = 1_000
"""The recommended --flow-records-rate (docs/observability.md)."""
EVERY_RECORD = 1_000_000
"""A --flow-records-rate above any connection rate the client reaches: every one recorded."""
FLOW_CYCLES = 7
"""Cycles of one round per flow-record rate, each round after a restart of the daemon."""
FLOW_GOAL = 0.90
QUIET = 0.05
"""A restarted daemon has settled once its CPU over half a second is under this share of a
core (its start's listing and first syncs done), or after SETTLE_LIMIT seconds."""
SETTLE_LIMIT = 15.0


@dataclass
class Figure:
    step: str
    figure: str
    knit: str
    anchor: str
    ratio: str
    goal: str


def goal(text: str, met: bool) -> str:
    return f"{text}: {'met' if met else 'NOT met'}"


def namespace_name(index: int) -> str:
    return f"bench-{index}"


def simulated_address(index: int) -> str:
    return str(ipaddress.IPv4Address("10.200.0.0") + index)


def policy_spec(index: int) -> dict[str, Any]:
    return {
        "podSelector": {"matchLabels": {"app": f"a{index % 20}"}},
        "ingress": [
            {
                "from": [
                    {
                        "namespaceSelector": {"matchLabels": {"team": f"t{index % 10}"}},
                        "podSelector": {"matchLabels": {"tier": f"t{index % 5}"}},
                    }
                ],
                "ports": [{"port": CONNECTION_PORT}, {"port": "web"}],
            }
        ],
    }


@dataclass
class FlowRound:
    """One round of connections with the daemon recording flows at `rate` a second (0: off)."""

    rate: int
    connections: float
    """Connections a second to the selected pod."""
    unjudged: float
    """Connections a second to the pod no policy selects, in a round beside it: what the
    machine's other load let through meanwhile."""
    cpu: float
    """The daemon's CPU seconds over the round's wall seconds."""
    records: int
    lost_limit: int
    lost_buffer: int

    def line(self) -> str:
        return (
            f"flow records at {self.rate:,}/s: {self.connections:,.0f} connections/s "
            f"({self.unjudged:,.0f}/s to the unjudged pod), "
            f"{self.records:,} records, {self.lost_limit:,} lost over the limit, "
            f"{self.lost_buffer:,} in the buffer, daemon CPU {self.cpu * 100:.0f}% of a core"
        )


class PolicyBench:
    def __init__(self, cluster: Cluster, node: LabNode) -> None:
        self.cluster = cluster
        self.kube: Kube = cluster.kube
        self.node = node
        self.figures: list[Figure] = []
        self.pods = 0
        self.open_address = ""
        """The pod no policy selects."""
        self.flow_rounds: list[FlowRound] = []

    # ------------------------------------------------------------ objects
    def bulk(self, calls: list[Callable[[], Any]]) -> None:
        with ThreadPoolExecutor(16) as pool:
            for future in [pool.submit(call) for call in calls]:
                future.result()

    def make_namespaces(self) -> None:
        self.bulk(
            [
                partial(self.kube.create_namespace, namespace_name(i), {"team": f"t{i % 10}"})
                for i in range(NAMESPACES)
            ]
        )

    def register(self, pod: LabPod, namespace: str, labels: dict[str, str]) -> None:
        """The Pod object of a real pod: what kubelet would report."""
        ports = [("web", CONNECTION_PORT, "TCP")]
        obj = pod_object(pod.name, self.node.name, labels, ports)
        self.kube.create_running_pod(namespace, obj, pod.addresses)

    def grow_pods(self, total: int) -> None:
        def one(index: int) -> None:
            namespace, name = namespace_name(index % NAMESPACES), f"sim-{index}"
            labels = {"app": f"a{index % 20}", "tier": f"t{index // NAMESPACES % 5}"}
            node = f"peer-{index % 100}"
            obj = pod_object(name, node, labels, [("web", CONNECTION_PORT, "TCP")])
            self.kube.create_running_pod(namespace, obj, (simulated_address(index),))

        self.bulk([partial(one, i) for i in range(self.pods, total)])
        self.pods = total

    def make_policies(self) -> None:
        def one(index: int) -> None:
            path = f"/apis/networking.k8s.io/v1/namespaces/{namespace_name(index % NAMESPACES)}"
            self.kube.create(
                f"{path}/networkpolicies",
                {"metadata": {"name": f"policy-{index}"}, "spec": policy_spec(index)},
            )

        self.bulk([partial(one, i) for i in range(POLICIES)])

    # ------------------------------------------------------------ the kernel, from the node
    def in_node(self, fn: Callable[[], T]) -> T:
        """fn's result, run in a thread that entered the node's network namespace."""
        return in_netns(Netns(self.node.ns), fn)

    def wait_for(self, check: Callable[[Nft], bool], timeout: float = 30.0) -> float:
        """Seconds until check(nft) holds, polled from the node namespace."""

        def poll() -> float:
            nft = Nft(4, TABLE)
            began = time.monotonic()
            while not check(nft):
                if time.monotonic() - began > timeout:
                    raise TimeoutError("the change did not reach the kernel")
                time.sleep(0.0005)
            return time.monotonic() - began

        return self.in_node(poll)

    # ------------------------------------------------------------ measurements
    def label_change_latency(self, step: str, client_set: str) -> None:
        """A simulated pod of the selected namespace moves in and out of the client's peer
        set by its tier label."""
        namespace = SELECTED_NAMESPACE
        index = NAMESPACES  # in the selected namespace, of tier t1
        name, address = f"sim-{index}", simulated_address(index)
        path = f"/api/v1/namespaces/{namespace}/pods/{name}"

        def member(nft: Nft) -> bool:
            return in_set(nft, client_set, address)

        samples = []
        for turn in range(SAMPLES):
            joins = turn % 2 == 0
            tier = "t0" if joins else "t1"
            self.kube.patch(path, {"metadata": {"labels": {"tier": tier}}})

            def settled(nft: Nft, joins: bool = joins) -> bool:
                return member(nft) == joins

            samples.append(self.wait_for(settled))
        self.add_latency(step, "pod label change -> peer set element in the kernel", samples)

    def policy_change_latency(self, step: str) -> None:
        """A policy with a peer block of its own is created and deleted again."""
        collection = f"/apis/networking.k8s.io/v1/namespaces/{SELECTED_NAMESPACE}/networkpolicies"
        sets_before = self.in_node(lambda: Nft(4, TABLE).sets())
        samples = []
        for turn in range(SAMPLES):
            name = f"change-{turn}"
            spec = {
                "podSelector": {"matchLabels": {"app": "a0"}},
                "ingress": [{"from": [{"ipBlock": {"cidr": f"192.0.2.{turn}/32"}}]}],
            }
            self.kube.create(collection, {"metadata": {"name": name}, "spec": spec})
            samples.append(self.wait_for(lambda nft: len(nft.sets()) > len(sets_before)))
            self.kube.delete(f"{collection}/{name}")
            samples.append(self.wait_for(lambda nft: len(nft.sets()) == len(sets_before)))
        self.add_latency(
            step, "policy created or deleted -> its set in or out of the kernel", samples
        )

    def add_latency(self, step: str, figure: str, samples: list[float]) -> None:
        median = statistics.median(samples)
        self.figures.append(
            Figure(
                step,
                f"{figure} (min/median/max of {len(samples)})",
                f"{min(samples) * 1000:.1f}/{median * 1000:.1f}/{max(samples) * 1000:.1f} ms",
                "",
                "",
                goal(f"median <= {LATENCY_GOAL * 1000:.0f} ms", median <= LATENCY_GOAL),
            )
        )

    def first_sync(self) -> tuple[float, float, float]:
        """The daemon restarted over every object: its first policy sync's wall time, the
        part of it loading nft and its CPU time, in seconds."""
        self.cluster.stop_daemon(self.node)
        self.in_node(lambda: [Nft(family, TABLE).delete_table() for family in (4, 6)])
        return self.start_synced()

    def start_synced(self, *flags: str) -> tuple[float, float, float]:
        """The daemon started with `flags`, once its first policy sync is logged: that sync's
        wall time, the part of it loading nft and its CPU time, in seconds."""
        logged = self.node.log.stat().st_size
        self.cluster.start_daemon(self.node, *flags)

        def logged_sync() -> tuple[float, float, float] | None:
            with self.node.log.open() as log:
                log.seek(logged)
                found = FIRST_SYNC.search(log.read())
            if found is None:
                return None
            wall, loading, cpu = (float(found.group(i)) / 1000 for i in (1, 2, 3))
            return wall, loading, cpu

        timed: tuple[float, float, float] = eventually(logged_sync, 120, "the first policy sync")
        return timed

    def bare_load(self) -> tuple[float, float, str]:
        """Seconds an `nft -f` process takes to load the tables the daemon wrote into a fresh
        namespace, seconds one takes to load nothing there (its start and exit), and the
        tables' text."""
        tables = "".join(
            in_ns(self.node.ns, "nft", "list", "table", family, TABLE) for family in ("ip", "ip6")
        )
        bare_ns = unique_name("bare")
        subprocess.run(["ip", "netns", "add", bare_ns], check=True)
        try:
            timings = []
            for text in (tables, ""):
                began = time.monotonic()
                subprocess.run(
                    ["ip", "netns", "exec", bare_ns, "nft", "-f", "-"],
                    input=text,
                    text=True,
                    check=True,
                )
                timings.append(time.monotonic() - began)
            return timings[0], timings[1], tables
        finally:
            subprocess.run(["ip", "netns", "del", bare_ns], check=True)

    def full_sync(self, step: str) -> None:
        """The first policy sync after each of STARTS restarts, against a bare `nft -f` of
        the tables it wrote after each; medians of both. Beside the bare load, an nft process
        loading nothing: what of the anchor is the process rather than the tables."""
        syncs, bares, empties = [], [], []
        for _ in range(STARTS):
            syncs.append(self.first_sync())
            bare, empty, tables = self.bare_load()
            bares.append(bare)
            empties.append(empty)
        wall, loading, cpu = (statistics.median(part) for part in zip(*syncs, strict=True))
        bare = statistics.median(bares)
        ratio = wall / bare
        self.figures.append(
            Figure(
                step,
                f"policy full sync at start (compile and transaction, both families; "
                f"median of {STARTS} starts)",
                f"{wall * 1000:.0f} ms ({loading * 1000:.0f} ms of it loading nft; "
                f"{cpu * 1000:.0f} ms of CPU)",
                f"bare nft -f of the same tables ({len(tables):,} bytes) {bare * 1000:.0f} ms; "
                f"of an empty file {statistics.median(empties) * 1000:.0f} ms",
                f"{ratio:.2f}x",
                goal(f"<= {FULL_SYNC_GOAL}x", ratio <= FULL_SYNC_GOAL),
            )
        )

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.node.daemon}/status").read_text()
        kib = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS"))
        return kib / 1024

    def memory(self, step: str) -> None:
        on = self.rss_mib()
        self.cluster.stop_daemon(self.node)
        self.cluster.start_daemon(self.node, "--network-policy=false")
        time.sleep(10)
        off = self.rss_mib()
        self.cluster.stop_daemon(self.node)
        self.cluster.start_daemon(self.node)
        self.figures.append(
            Figure(
                step,
                "daemon resident memory, policy on (after its first sync)",
                f"{on:.0f} MiB",
                f"policy off {off:.0f} MiB",
                f"+{on - off:.0f} MiB",
                "",
            )
        )

    def connection_rate(self, step: str, client: LabPod, selected: LabPod, open_: LabPod) -> None:
        seconds, repeats = CONNECTION_SECONDS, 7
        rates: dict[str, list[float]] = {"selected": [], "open": []}
        targets = {"selected": selected.address(4), "open": open_.address(4)}
        for turn in range(repeats):
            order = ["selected", "open"] if turn % 2 == 0 else ["open", "selected"]
            for kind in order:
                rates[kind].append(connections(client, targets[kind], seconds))
        share = statistics.median(
            a / b for a, b in zip(rates["selected"], rates["open"], strict=True)
        )
        spread = {
            k: f"{min(v):.0f}/{statistics.median(v):.0f}/{max(v):.0f}/s" for k, v in rates.items()
        }
        self.figures.append(
            Figure(
                step,
                f"TCP connections/s to a pod policies select (min/median/max of {repeats} x 2 s)",
                spread["selected"],
                f"to a pod no policy selects {spread['open']}",
                f"{share:.2f}x",
                goal(f">= {CONNECTION_GOAL}x", share >= CONNECTION_GOAL),
            )
        )

    def connection_cut(self, step: str, client: LabPod, echo: LabPod, load: int) -> None:
        """The client's tier label moves it out of (and back into) the peer set allowing it
        to the echo pod, while it holds a connection there; `load` more conntrack entries on
        the node meanwhile."""
        path = f"/api/v1/namespaces/{SELECTED_NAMESPACE}/pods/{client.name}"
        client_set = client_peer_set(self, client)

        def member(nft: Nft) -> bool:
            return in_set(nft, client_set, client.address(4))

        # what the connection rate left, and the last run's load, out of the count
        in_ns(self.node.ns, "conntrack", "-F")
        if load:
            in_ns(self.node.ns, "sysctl", "-qw", "net.netfilter.nf_conntrack_udp_timeout=600")
            in_ns(client.ns, sys.executable, "-c", UDP_FLOWS, self.open_address, str(load))
        entries = int(in_ns(self.node.ns, "cat", "/proc/sys/net/netfilter/nf_conntrack_count"))
        cuts, removals = [], []
        for _ in range(CUT_SAMPLES):
            with HeldConnection(client.ns, echo.address(4), CONNECTION_PORT) as held:
                self.kube.patch(path, {"metadata": {"labels": {"tier": "t9"}}})
                changed = time.monotonic()
                with ThreadPoolExecutor(1) as pool:
                    removal = pool.submit(self.wait_for, lambda nft: not member(nft))
                    cuts.append(held.cut_after(changed, limit=30, every=0.005))
                    removals.append(removal.result())
            self.kube.patch(path, {"metadata": {"labels": {"tier": "t0"}}})
            self.wait_for(member)

        cut, removed = statistics.median(cuts), statistics.median(removals)
        self.figures.append(
            Figure(
                step,
                f"label change -> the client's open connection cut, {entries:,} conntrack "
                f"entries on the node before (min/median/max of {CUT_SAMPLES})",
                f"{min(cuts) * 1000:.0f}/{cut * 1000:.0f}/{max(cuts) * 1000:.0f} ms",
                f"its address out of the peer set in the kernel {removed * 1000:.1f} ms",
                f"{cut / removed:.1f}x",
                goal(f"median <= {CUT_GOAL * 1000:.0f} ms", cut <= CUT_GOAL),
            )
        )

    # ------------------------------------------------------------ flow records
    def daemon_cpu(self) -> float:
        """The daemon's CPU seconds so far, user and system, all its threads."""
        stat = Path(f"/proc/{self.node.daemon}/stat").read_text()
        fields = stat.rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def record_counts(self) -> tuple[int, int, int]:
        """The daemon's flow records so far, and the records lost over the limit and in its
        socket's buffer (its metrics; zeros with records off)."""

        def scrape() -> str:
            with urllib.request.urlopen(METRICS, timeout=10) as reply:
                text: str = reply.read().decode()
            return text

        records, lost = 0.0, {"limit": 0.0, "buffer": 0.0}
        for family in text_string_to_metric_families(self.in_node(scrape)):
            for sample in family.samples:
                if sample.name == "knit_network_policy_connections_total":
                    records += sample.value
                elif sample.name == "knit_network_policy_flow_records_lost_total":
                    lost[sample.labels["reason"]] = sample.value
        return int(records), int(lost["limit"]), int(lost["buffer"])

    def settle(self) -> None:
        """Until the daemon is quiet (QUIET), at most SETTLE_LIMIT seconds."""
        began = time.monotonic()
        while time.monotonic() - began < SETTLE_LIMIT:
            cpu = self.daemon_cpu()
            time.sleep(0.5)
            if self.daemon_cpu() - cpu < QUIET * 0.5:
                return

    def flow_round(
        self, rate: int, client: LabPod, target: str, unjudged: str, unjudged_first: bool
    ) -> FlowRound:
        """The daemon restarted recording `rate` flows a second, then a round of connections
        to `target` and one to the `unjudged` address, in that order or the other; the
        daemon's CPU and records over the target's round and the flush of NFLOG's last
        batch."""
        self.cluster.stop_daemon(self.node)
        self.start_synced(f"--flow-records-rate={rate}")
        self.settle()
        beside = connections(client, unjudged, CONNECTION_SECONDS) if unjudged_first else 0.0
        cpu, counts = self.daemon_cpu(), self.record_counts()
        began = time.monotonic()
        rate_seen = connections(client, target, CONNECTION_SECONDS)
        time.sleep(2 * FLUSH_TIMEOUT / 100)
        wall = time.monotonic() - began
        used = self.daemon_cpu() - cpu
        records, limit, buffer = (
            after - before for after, before in zip(self.record_counts(), counts, strict=True)
        )
        if not unjudged_first:
            beside = connections(client, unjudged, CONNECTION_SECONDS)
        return FlowRound(rate, rate_seen, beside, used / wall, records, limit, buffer)

    def flow_record_cost(
        self, step: str, client: LabPod, selected: LabPod, open_: LabPod, rates: tuple[int, ...]
    ) -> None:
        """Connections to the selected pod with records off, and at each of `rates`, a round
        each per cycle in turns, each beside a round to the pod no policy selects.

        A rate's ratio is the median of its cycles' own: the selected pod's connections/s as
        a share of the unjudged pod's beside it, over the same share with records off. The
        rounds of one cycle are a restart apart, and on a shared machine its other load
        changes meanwhile, which the share takes out (the unjudged pod's connections are
        never logged: records cost them nothing); the plain ratio of the selected pod's
        rates is printed beside it."""
        kinds = (0, *rates)
        cycles: list[dict[int, FlowRound]] = []
        for turn in range(FLOW_CYCLES):
            cycle: dict[int, FlowRound] = {}
            for rate in kinds[turn % len(kinds) :] + kinds[: turn % len(kinds)]:
                cycle[rate] = self.flow_round(
                    rate, client, selected.address(4), open_.address(4), turn % 2 == 1
                )
                self.flow_rounds.append(cycle[rate])
                print(cycle[rate].line(), flush=True)
            cycles.append(cycle)
        off = [cycle[0] for cycle in cycles]
        for rate in rates:
            on = [cycle[rate] for cycle in cycles]
            pairs = list(zip(on, off, strict=True))
            shares = [(a.connections / a.unjudged) / (b.connections / b.unjudged) for a, b in pairs]
            plain = [a.connections / b.connections for a, b in pairs]
            share = statistics.median(shares)
            written = statistics.median(r.records for r in on)
            limit = statistics.median(r.lost_limit for r in on)
            buffer = statistics.median(r.lost_buffer for r in on)
            self.figures.append(
                Figure(
                    step,
                    f"TCP connections/s to a pod a policy isolates and allows, flow records at "
                    f"{rate:,}/s (min/median/max of {FLOW_CYCLES} x {CONNECTION_SECONDS:.0f} s, "
                    f"each after a restart; ratio: the median and min-max of the cycles' "
                    f"shares of the unjudged pod's rate beside them, on over off; then of the "
                    f"plain ratios)",
                    f"{spread(r.connections for r in on)}; a round's records (median) "
                    f"{written:,.0f} written, {limit:,.0f} lost over the limit, {buffer:,.0f} "
                    f"in the buffer; daemon CPU {cpu_share(on)}",
                    f"records off {spread(r.connections for r in off)}; daemon CPU "
                    f"{cpu_share(off)}",
                    f"{share:.2f}x ({min(shares):.2f}-{max(shares):.2f}); plain "
                    f"{statistics.median(plain):.2f}x ({min(plain):.2f}-{max(plain):.2f})",
                    goal(f">= {FLOW_GOAL}x", share >= FLOW_GOAL),
                )
            )


def connections(client: LabPod, address: str, seconds: float) -> float:
    """TCP connections a second from the client to address, sequential connect + reset."""
    out = in_ns(
        client.ns, sys.executable, "-c", CLIENT_LOOP, address, str(CONNECTION_PORT), str(seconds)
    )
    return float(out)


def spread(values: Iterable[float]) -> str:
    listed = list(values)
    return f"{min(listed):,.0f}/{statistics.median(listed):,.0f}/{max(listed):,.0f}/s"


def cpu_share(rounds: list[FlowRound]) -> str:
    """The daemon's CPU over the rounds, min/median/max, in percent of a core."""
    shares = [r.cpu * 100 for r in rounds]
    return f"{min(shares):.0f}/{statistics.median(shares):.0f}/{max(shares):.0f}% of a core"


def in_set(nft: Nft, set_name: str, address: str) -> bool:
    """Whether the policy table's set holds the address (a libnftables `get element`)."""
    try:
        nft.run(f"get element ip {TABLE} {set_name} {{ {address} }}")
    except NftError:
        return False
    return True


def serve_connections(cluster: Cluster, pod: LabPod) -> None:
    cluster.spawn(
        ["ip", "netns", "exec", pod.ns, sys.executable, "-c", SERVER, str(CONNECTION_PORT)],
        cluster.folder / f"{pod.name}-server.log",
    )
    eventually(
        lambda: f":{CONNECTION_PORT} " in in_ns(pod.ns, "ss", "-ltnH"),
        what=f"the connection server in {pod.name}",
    )


def client_peer_set(bench: PolicyBench, client: LabPod) -> str:
    """The peer set holding the client's address (every policy selecting the server names it)."""

    def find() -> str:
        nft = Nft(4, TABLE)
        for name in sorted(nft.sets()):
            if name.startswith("peers-") and in_set(nft, name, client.address(4)):
                return name
        return ""

    found: str = eventually(lambda: bench.in_node(find), 120, what="the client's peer set")
    return found


def run(options: argparse.Namespace, folder: Path) -> PolicyBench:
    plane: ControlPlane = start(folder / "controlplane")
    bundle = folder / "cni-bundle"
    cni_client = PLUGIN_DIR / "knit"
    subprocess.run(
        [sys.executable, "-m", "cni.bundle", "--output", str(bundle), "--client", str(cni_client)],
        check=True,
    )
    try:
        with Cluster(unique_name("pb"), folder / "lab", plane, bundle) as cluster:
            lan = cluster.add_segment("lan", "10.79.1.0/24", "fd79:1::/64")
            node = cluster.add_node("a", lan, 11, ("10.244.1.0/24", "fd10:244:0:1::/64"))
            bench = PolicyBench(cluster, node)
            bench.make_namespaces()
            client = cluster.add_pod(node, unique_name("client"))
            selected = cluster.add_pod(node, unique_name("selected"))
            open_ = cluster.add_pod(node, unique_name("open"))
            echo = cluster.add_pod(node, unique_name("echo"))
            bench.open_address = open_.address(4)
            bench.register(client, SELECTED_NAMESPACE, {"app": "client", "tier": "t0"})
            bench.register(selected, SELECTED_NAMESPACE, {"app": "a0", "tier": "t9"})
            bench.register(echo, SELECTED_NAMESPACE, {"app": "a0", "tier": "t9"})
            cluster.serve(echo.ns, CONNECTION_PORT, cluster.folder / "echo.log")
            cluster.kube.create_namespace("bench-open")
            bench.register(open_, "bench-open", {"app": "open"})
            for pod in (selected, open_):
                serve_connections(cluster, pod)
            bench.make_policies()
            for size in options.pods:
                began = time.monotonic()
                bench.grow_pods(size)
                step = f"{size:,} pods, {POLICIES:,} policies"
                print(f"{step}: objects made in {time.monotonic() - began:.0f} s", flush=True)
                client_set = client_peer_set(bench, client)
                bench.label_change_latency(step, client_set)
                bench.policy_change_latency(step)
            bench.full_sync(step)
            bench.memory(step)
            client_peer_set(bench, client)
            bench.connection_rate(step, client, selected, open_)
            for load in (0, CONNTRACK_LOAD):
                bench.connection_cut(step, client, echo, load)
            bench.flow_record_cost(step, client, selected, open_, (FLOW_RATE, EVERY_RECORD))
            return bench
    finally:
        plane.stop()


def table(figures: list[Figure]) -> str:
    lines = [
        "| step | figure | knit | anchor | ratio | goal |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {f.step} | {f.figure} | {f.knit} | {f.anchor} | {f.ratio} | {f.goal} |" for f in figures
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--pods", type=lambda text: [int(n) for n in text.split(",")], default=list(SIZES),
        help="pod counts to measure at, in growing order (default 1000,10000)",
    )  # fmt: skip
    record.add_json_option(parser)
    options = parser.parse_args()
    began_at = record.revision()
    exit_on_termination()
    folder = Path(tempfile.mkdtemp(prefix="policy-bench-"))
    try:
        bench = run(options, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(table(bench.figures))
    variant = "" if options.pods == list(SIZES) else "pods-" + "-".join(map(str, options.pods))
    path = record.result_path(options.json, "policy", variant)
    figures = [asdict(figure) for figure in bench.figures]
    rounds = [asdict(round_) for round_ in bench.flow_rounds]
    record.write(path, figures, began_at, flow_record_rounds=rounds)


if __name__ == "__main__":
    main()
