"""knit-proxyd's iptables and nftables modes at scale, side by side, each figure beside an
anchor measured in the same run.

A real etcd + kube-apiserver on host loopback holds N Services (one TCP port each), each with
an EndpointSlice of 10 endpoints on another node. For each N and each mode (--modes, default
both), knit-proxyd starts in a fresh node namespace (with the tests' flags: its CNI files in
the run's folder, no routing) and is measured:

- full sync: the daemon's own metric (exactly one full sync at start, which writes both
  families, the IPv6 rules being the fixed part only), against a bare load of exactly the rules
  it wrote, in both families, into a fresh namespace, from a thread inside that namespace
  (iptables: through the daemon's own wrapper, `restore --noflush` of iptables-save of its nat and
  filter tables, then the same in IPv6, on the nft flavour in batches of the daemon's chains per
  restore; nftables: an `nft -f` process (the daemon runs libnftables in its own process) of
  `nft list table ip knit` and `... ip6 knit`, one transaction, where the daemon writes each
  table, which has no chains yet, in chunks loaded while the next is made, and at steady state
  one transaction that nft parses while the rest is made); the wall time from its start to the
  rules being in the kernel, and the start-up before the full sync (wall minus metric); then
  full syncs at steady state (forced by changing the Node's zone, medians of several) against
  bare reloads of the same rules over themselves (nftables: `delete table` of both and the
  listings, in one transaction: nft's `flush table` empties the chains but leaves every set
  and map element in place, so a reload after it would only re-add what is there, where the
  daemon's full sync replaces the maps' contents);
- its resident memory (VmRSS of the interpreter);
- one-service changes (one endpoint of one EndpointSlice replaced): the partial sync's own
  metric against a bare load of the same change, rendered by the daemon's code in the context
  its proxier builds for the node (and checked to leave the anchor's chain equal to the
  daemon's), and the latency from the PATCH returning to the new endpoint being in the kernel,
  by the daemon's last-sync timestamp; in separate changes, when a look is cheap, also polled
  from outside (`iptables -S <chain>` / `nft list chain ip knit <chain>`), so the metric
  samples of both modes are taken alike;

and at the largest N:

- TCP connections per second (sequential connect + reset) from a client namespace to a
  ClusterIP (iptables: the one whose rule is the last service rule of KNIT-SERVICES; nftables:
  the same service, any one costs one verdict-map lookup), against two directs: the backend
  reached through a node namespace without any rules (the goal's), and the backend reached
  directly through the same node; and against the least a NAT datapath does, a node whose
  only rule is one verdict-map lookup DNATing the same address to the same endpoints (the
  connection tracking every NAT needs, without anything of knit's), itself measured against
  direct through a node without rules: the floor the goal sits on. The loads take turns, a
  round being one run of each, back to back, each round starting one load further on; a
  ratio is the median of the rounds' own ratios, so that the machine's slower and faster
  spells (+-20% here) fall on both of its sides.

After knit-proxyd, at each N and in each mode, the real kube-proxy (built from the pinned
kubernetes module) starts in a fresh node namespace of the same layout, against the same API
server and objects, and the figures both can give are taken of it the same way, from its own
metrics under the same names: cold start to its first full sync done, the full sync at start
and forced at steady state, one-service changes (its partial sync, and from the PATCH to the
rules in the kernel by the network programming metric: every change the bench makes stamps
the EndpointSlice's last-change-trigger-time, as the EndpointSlice controller does), resident
memory after start and at peak, the CPU time each daemon spends per minute with nothing
changing (over a minute once synced, 30 s with --quick) and over a churn of 1,000 endpoint
changes, and at the largest N connections/s through the same ClusterIP as a share of
direct through a node without rules. Each becomes a row beside knit-proxyd's, with the ratio.

The run ends with every figure as measured, then a table comparing the modes per N with the
nftables mode's goals marked met or not: connections through a ClusterIP at the largest N at
least 80% of direct through a node without rules, a one-service change under 20 ms whose
partial sync does not grow from the smallest N to the largest (at most 1.5x, printed beside
the bare tool's growth), and full syncs at most 1.5x the bare `nft -f`; beside kube-proxy at
the largest N, knit-proxyd at or ahead of it on every figure, and a one-service change at most
a tenth of its. The figures beside kube-proxy are also drawn as a PNG next to the result file
(bench/chart.py).

That a sync ended is read from the line the daemon logs after it; its metrics are read once
then, not polled during the sync they measure (a look is a request the daemon serves). Only
kube-proxy's IPVS mode logs no such line at its default verbosity: its sync counts are read
every half second instead.

`--flavour legacy` makes the node look like one whose kubelet uses iptables-legacy (kubelet's
hint chain), so the iptables mode detects and uses legacy; by default it detects nft, as on
any fresh node here. A first full sync that takes longer than --sync-timeout ends that size.

Run as root from the repository root (~25 minutes on a 2-core VM, 2-3 of them creating the
20,000 objects):
  .venv/bin/python -m bench.proxy_bench [--sizes 1000,10000] [--modes iptables,nftables]
      [--flavour nft|legacy] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import pstats
import shlex
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

from bench import record
from bench.proxy_changes import OneServiceChanges
from bench.proxy_cluster import (
    CHURN_CHANGES,
    CHURN_SERVICES,
    CLUSTER_CIDR,
    NODE,
    NODE_ADDRESS,
    PORT,
    TARGET_PORT,
    SliceChange,
    bench_api,
    create_services,
    service_name,
    start_knit,
)
from bench.proxy_connections import BACKENDS, Connections
from bench.proxy_daemon import (
    FULL,
    KNIT,
    KUBE_PROXY,
    LAST_SYNC,
    PARTIAL,
    PENDING,
    Daemon,
    programming,
)
from bench.proxy_modes import Iptables, Ipvs, Mode, Nftables, Saved
from bench.proxy_netns import make_netns
from bench.proxy_report import (
    CHURN,
    COLD,
    CONNECTIONS,
    FIRST,
    IDLE,
    PARTIAL_SYNC,
    PROGRAMMED,
    RSS_PEAK,
    RSS_START,
    STEADY,
    Results,
    Row,
    paired,
    ratio,
    secs,
)
from deploy.lab.controlplane import ControlPlane
from deploy.lab.kube import SERVICES, Kube, node_object
from deploy.lab.netns import Netns
from deploy.lab.process import eventually, exit_on_termination
from deploy.lab.relay import NetnsForward
from proxyd.model import ZONE_LABEL

FORCED_FULL_LIMIT = 120.0
"""No forced full sync at steady state when the first one took longer than this (seconds)."""
SETTLE_SECONDS = 1.5
"""How long no full sync must come before the table is read at start."""
IDLE_SECONDS = 60.0
"""How long the daemons are watched doing nothing, once synced."""
FULL_SYNC_GOAL = 1.5
"""nftables: a full sync costs at most this many bare `nft -f` of the same rules."""


class Bench:
    """The run: at each N and in each mode, knit-proxyd's figures, then kube-proxy's, each
    daemon in a fresh node namespace."""

    def __init__(
        self, options: argparse.Namespace, plane: ControlPlane, kube: Kube, work: Path
    ) -> None:
        self.options = options
        self.plane = plane
        self.kube = kube
        self.work = work
        self.results = Results()
        self.repeats = 1 if options.quick else 3
        self.fresh = (f"10.244.150.{host}" for host in itertools.count(1))
        """Addresses no endpoint had, for one-service changes."""
        self.churn_addresses = (
            f"10.244.{100 + n // 250 % 50}.{n % 250 + 1}" for n in itertools.count()
        )
        """Endpoint addresses for the churns, in 10.244.100.0-10.244.149.255 (reused after
        12,500: an address comes back long after it was replaced)."""
        self.changes = OneServiceChanges(kube, self.results, self.fresh, options.quick)
        self.connections = Connections(kube, self.results, options.quick)

    def size(self, size: int, mode: Mode, largest: bool) -> None:
        heading = f"{size} services, knit-proxyd in {mode.name} mode (anchors: bare {mode.loader})"
        print(f"\n{heading}:", flush=True)
        tag = f"{mode.name}-{size}"
        profile = self.work / f"proxyd-{tag}.prof" if self.options.profile else None
        with ExitStack() as stack:
            node, kubeconfig, folder = self.node(tag, mode, stack)
            log = self.work / f"proxyd-{tag}.log"
            daemon = start_knit(node, kubeconfig, folder, mode.name, log, profile)
            stack.callback(daemon.stop)
            self.measure(size, mode, largest, daemon, stack)
        if profile is not None:
            print(f"  the daemon's main thread, under cProfile ({profile}):")
            pstats.Stats(str(profile)).sort_stats("cumulative").print_stats("proxyd/", 25)
        print(f"\n{size} services, kube-proxy in {mode.name} mode, the same figures:", flush=True)
        with ExitStack() as stack:
            node, kubeconfig, folder = self.node(f"kube-proxy-{tag}", mode, stack)
            peer = Daemon.kube_proxy(node, kubeconfig, NODE, CLUSTER_CIDR, mode.name, folder)
            stack.callback(peer.stop)
            self.measure_peer(size, mode, largest, peer, stack)

    def node(self, tag: str, mode: Mode, stack: ExitStack) -> tuple[Netns, Path, Path]:
        """A fresh node namespace as the mode expects it, a kubeconfig for a daemon inside it,
        and a folder for its files; removed when stack closes."""
        node = make_netns("node", stack)
        mode.prepare(node)
        forward = NetnsForward(node.name, self.plane.port)
        stack.callback(forward.stop)
        kubeconfig = self.plane.write_kubeconfig(
            self.work / f"kubeconfig-{tag}", forward.listen_port
        )
        folder = self.work / tag
        folder.mkdir(parents=True)
        return node, kubeconfig, folder

    def measure_peer(
        self, size: int, mode: Mode, largest: bool, daemon: Daemon, stack: ExitStack
    ) -> None:
        """kube-proxy's figures that knit-proxyd's are set beside, taken the same way."""
        try:
            synced = daemon.wait_sync(FULL, 0, self.options.sync_timeout)
        except TimeoutError:
            knit = self.results.beside.get((mode.name, size), {}).get(FIRST, {}).get(KNIT)
            figure = f"beside kube-proxy: {FIRST.name}"
            limit = f"kube-proxy not done within {self.options.sync_timeout:.0f} s"
            self.results.report.add(Row(mode.name, size, figure, secs(knit) if knit else "", limit))
            return
        first = daemon.spent(synced, {}, FULL)
        self.results.note(mode, size, COLD, KUBE_PROXY, synced[LAST_SYNC] - daemon.started)
        self.results.note(mode, size, FIRST, KUBE_PROXY, first)
        self.results.note(mode, size, RSS_START, KUBE_PROXY, daemon.memory_mib()[0])
        self.results.note(mode, size, IDLE, KUBE_PROXY, self.idle_cpu(daemon))
        if first < FORCED_FULL_LIMIT:
            forced = [self.force_full_sync(size, mode, daemon, n) for n in range(self.repeats)]
            done = [sync for sync in forced if sync is not None]
            if len(done) == len(forced):
                self.results.note(mode, size, STEADY, KUBE_PROXY, statistics.median(done))
        change = SliceChange(self.kube, service_name(size // 2))
        syncs, latencies = [], []
        for _ in range(5 if self.options.quick else 10):
            time.sleep(1.0)  # kube-proxy's default minSyncPeriod, since the last sync
            before, since = daemon.metrics(), daemon.log_size()
            change.apply(next(self.fresh))
            after = daemon.wait_sync(PARTIAL, since, 60, change=before)
            syncs.append(daemon.spent(after, before, PARTIAL))
            latencies.append(programming(after, before))
        self.results.note(mode, size, PARTIAL_SYNC, KUBE_PROXY, statistics.median(syncs))
        self.results.note(mode, size, PROGRAMMED, KUBE_PROXY, statistics.median(latencies))
        # before the churn, which may change the target's endpoints
        if largest and (target := self.connections.targets.get(mode.name)):
            client_ns = self.connections.attach(daemon.ns, stack)
            plain_client = self.connections.attach(make_netns("plain", stack), stack)
            cluster_ip = self.kube.call("GET", f"{SERVICES}/{target}")["spec"]["clusterIP"]
            rates = self.connections.rounds(
                {
                    "service": (client_ns, cluster_ip, PORT),
                    "plain": (plain_client, BACKENDS[-1], TARGET_PORT),
                }
            )
            self.results.note(
                mode, size, CONNECTIONS, KUBE_PROXY, paired(rates, "service", "plain")
            )
        self.results.note(mode, size, CHURN, KUBE_PROXY, self.churn(daemon))
        self.results.note(mode, size, RSS_PEAK, KUBE_PROXY, daemon.memory_mib()[1])

    def settled(self, daemon: Daemon) -> float:
        """The daemon's count of full syncs once none has come for SETTLE_SECONDS."""
        count, since = daemon.metrics()[f"{FULL}_count"], time.monotonic()
        while time.monotonic() - since < SETTLE_SECONDS:
            time.sleep(0.25)
            if (now := daemon.metrics()[f"{FULL}_count"]) != count:
                count, since = now, time.monotonic()
        return count

    def idle_cpu(self, daemon: Daemon) -> float:
        """CPU seconds per minute the daemon spends with nothing changing, over IDLE_SECONDS
        (half of it with --quick)."""
        seconds = IDLE_SECONDS / 2 if self.options.quick else IDLE_SECONDS
        began = daemon.cpu_seconds()
        time.sleep(seconds)
        return (daemon.cpu_seconds() - began) * 60 / seconds

    def churn(self, daemon: Daemon) -> float:
        """CPU seconds the daemon spends on CHURN_CHANGES endpoint changes, made one after the
        other as fast as the API takes them, each replacing one endpoint of one of the first
        CHURN_SERVICES services, until it has programmed them all (no change pending, a sync
        ended after the last)."""
        slices = [SliceChange(self.kube, service_name(index)) for index in range(CHURN_SERVICES)]
        began = daemon.cpu_seconds()
        for change in range(CHURN_CHANGES):
            slices[change % CHURN_SERVICES].apply(next(self.churn_addresses))
        patched = time.time()
        time.sleep(0.5)  # the last events reach the daemon's watch

        def programmed() -> bool:
            metrics = daemon.metrics()
            return metrics.get(PENDING, 0.0) == 0 and metrics[LAST_SYNC] > patched

        eventually(programmed, 300, f"{daemon.program}: the churn programmed", 0.5)
        return daemon.cpu_seconds() - began

    def measure(
        self, size: int, mode: Mode, largest: bool, daemon: Daemon, stack: ExitStack
    ) -> None:
        try:
            synced = daemon.wait_sync(FULL, 0, self.options.sync_timeout)
        except TimeoutError:
            limit = f"> {self.options.sync_timeout:.0f} s"
            self.results.add(mode, size, "full sync at start (metric)", f"not done, {limit}")
            return
        if (count := synced[f"{FULL}_count"]) != 1:
            raise RuntimeError(f"{count:.0f} full syncs at start, not one")
        full = daemon.spent(synced, {}, FULL)
        # the table is read once no other full sync follows: one that came after the first
        # (a ServiceCIDR list later than the Services', changing the base chains) would switch
        # the table's generation while it is listed, and the anchor would hold half of it
        if (more := self.settled(daemon) - 1) > 0:
            self.results.add(mode, size, "full syncs at start after the first", f"{more:.0f}")
        rss, _ = daemon.memory_mib()
        self.results.add(mode, size, "daemon memory after start (VmRSS)", f"{rss:.0f} MiB")
        saved = mode.save(daemon.ns)
        wall = synced[LAST_SYNC] - daemon.started
        for figure, value in ((COLD, wall), (FIRST, full), (RSS_START, rss)):
            self.results.keep(mode, size, figure, KNIT, value)
        self.results.note(mode, size, IDLE, KNIT, self.idle_cpu(daemon))
        anchor = self.bare_loads(size, mode, saved, full, wall, stack)
        if full < FORCED_FULL_LIMIT:
            self.forced_full_syncs(size, mode, daemon, anchor, saved)
        else:
            print(f"  no forced full sync: the first took {secs(full)}")
        self.changes.measure(size, mode, daemon, anchor)
        self.results.note(mode, size, CHURN, KNIT, self.churn(daemon))
        if largest:
            self.connections.measure(size, mode, daemon, saved, stack)
        rss, hwm = daemon.memory_mib()
        self.results.add(
            mode, size, "daemon memory at the end (VmRSS/peak)", f"{rss:.0f}/{hwm:.0f} MiB"
        )
        self.results.keep(mode, size, RSS_PEAK, KNIT, hwm)

    def bare_loads(
        self, size: int, mode: Mode, saved: Saved, full: float, wall: float, stack: ExitStack
    ) -> Netns:
        """Time loading `saved` into fresh namespaces; return the last one, left loaded until
        stack closes."""
        scripts = mode.scripts(saved, fresh=True)
        times = []
        for repeat in range(self.repeats):
            with ExitStack() as attempt:
                ns = make_netns("anchor", attempt)
                times.append(mode.load(ns, scripts))
                if repeat == self.repeats - 1:
                    stack.enter_context(attempt.pop_all())
        bare = statistics.median(times)
        what = f"bare {mode.loader} {secs(bare)} (transactions: {len(scripts)})"
        print(f"  the daemon wrote {mode.summary(saved)}")
        goal = (f"<= {FULL_SYNC_GOAL}x", full / bare <= FULL_SYNC_GOAL)
        figure = "full sync at start (metric)"
        self.results.add(mode, size, figure, secs(full), what, ratio(full, bare), goal)
        self.results.add(mode, size, "start to rules in kernel (wall)", secs(wall))
        self.results.add(
            mode, size, "start-up before the full sync (wall - metric)", secs(wall - full)
        )
        return ns

    def forced_full_syncs(
        self, size: int, mode: Mode, daemon: Daemon, anchor: Netns, saved: Saved
    ) -> None:
        scripts = mode.scripts(saved, fresh=False)
        figure = "full sync at steady state (metric, median)"
        forced, bares = [], []
        for repeat in range(self.repeats):
            if (forced_sync := self.force_full_sync(size, mode, daemon, repeat)) is None:
                self.results.add(
                    mode, size, figure, f"not done, > {self.options.sync_timeout:.0f} s"
                )
                return
            forced.append(forced_sync)
            bares.append(mode.load(anchor, scripts))
        sync, bare = statistics.median(forced), statistics.median(bares)
        self.results.keep(mode, size, STEADY, KNIT, sync)
        what = f"bare {mode.loader} over the same rules {secs(bare)}"
        goal = (f"<= {FULL_SYNC_GOAL}x", sync / bare <= FULL_SYNC_GOAL)
        self.results.add(mode, size, figure, secs(sync), what, ratio(sync, bare), goal)

    def force_full_sync(self, size: int, mode: Mode, daemon: Daemon, repeat: int) -> float | None:
        """Seconds of one full sync (the daemon's metric) forced by a change of the Node's
        zone; None when it did not end within --sync-timeout."""
        before, since = daemon.metrics(), daemon.log_size()
        zone = f"zone-{size}-{mode.name}-{daemon.program}-{repeat}"
        self.kube.patch(f"/api/v1/nodes/{NODE}", {"metadata": {"labels": {ZONE_LABEL: zone}}})
        try:
            after = daemon.wait_sync(FULL, since, self.options.sync_timeout, before=before)
        except TimeoutError:
            return None
        if daemon.syncs[FULL] and after[f"{FULL}_count"] != before[f"{FULL}_count"] + 1:
            raise RuntimeError("more than one full sync after one change of the Node")
        return daemon.spent(after, before, FULL)


MODES = ("iptables", "nftables")
"""The modes measured by default; `--modes ipvs` needs a kernel with IPVS (bench/proxy_vm.py
runs it in a VM node)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000", help="numbers of services, e.g. 1000")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="proxy modes to measure, e.g. nftables"
    )
    parser.add_argument("--flavour", choices=("nft", "legacy"), default="nft")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter loads")
    parser.add_argument(
        "--no-chart", dest="chart", action="store_false", help="no PNG beside the result file"
    )
    parser.add_argument(
        "--sync-timeout", type=float, default=300.0, help="seconds allowed for a full sync"
    )
    parser.add_argument(
        "--profile", action="store_true", help="run the daemon under cProfile, print its top"
    )
    record.add_json_option(parser)
    options = parser.parse_args()
    sizes = sorted(int(size) for size in options.sizes.split(","))
    names = options.modes.split(",")
    available: dict[str, Mode] = {
        "iptables": Iptables(options.flavour),
        "nftables": Nftables(),
        "ipvs": Ipvs(),
    }
    if unknown := set(names) - set(available):
        parser.error(f"unknown modes {', '.join(sorted(unknown))} (of {', '.join(available)})")
    modes = [available[name] for name in names]
    exit_on_termination()
    began_at = record.revision()
    print(f"at {began_at}", flush=True)
    with tempfile.TemporaryDirectory(prefix="knit-proxy-bench-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        plane, _, kube = bench_api(stack, work)
        kube.call("POST", "/api/v1/nodes", node_object(NODE, [NODE_ADDRESS], zone="zone-a"))
        bench = Bench(options, plane, kube, work)
        created = 0
        for size in sizes:
            took = create_services(kube, range(created, size))
            objects = 2 * (size - created)
            print(f"\ncreated {objects} objects in {secs(took)} ({objects / took:.0f}/s)")
            figure = f"creating {objects} objects via the API"
            bench.results.report.add(Row("api", size, figure, secs(took)))
            created = size
            for mode in modes:
                bench.size(size, mode, size == sizes[-1])
        bench.changes.size_growth(sizes, modes)
        bench.results.beside_kube_proxy(sizes[-1])
    print(f"\n{bench.results.report.table()}\n")
    print(f"{bench.results.report.comparison([mode.name for mode in modes])}\n")
    print(
        "connection goal: the ClusterIP's rate against direct through a node without rules; "
        "in the rows after it, against direct through the same node and against one "
        "verdict-map DNAT through a node without other rules, and that DNAT against direct "
        "through a node without rules (what any NAT costs here)"
    )
    print(f"command: {shlex.join(sys.orig_argv)} (at {began_at})")
    if (ended_at := record.revision()) != began_at:
        print(f"WARNING: the tree changed during the run: {began_at} at the start, {ended_at} now")
    path = record.result_path(options.json, "proxy", variant(options))
    record.write(path, [asdict(row) for row in bench.results.report.rows], began_at)
    if options.chart:
        # imported here: matplotlib is not in the VM node that runs the IPVS mode
        from bench import chart

        chart.draw(path, path.with_suffix(".png"))


def variant(options: argparse.Namespace) -> str:
    """The part of the result file's name saying how the run differs from the default one."""
    parts = []
    if options.sizes != "1000,10000":
        parts.append("sizes-" + options.sizes.replace(",", "-"))
    if options.modes != ",".join(MODES):
        parts.append(options.modes.replace(",", "-"))
    if options.flavour != "nft":
        parts.append(options.flavour)
    if options.quick:
        parts.append("quick")
    return "-".join(parts)


if __name__ == "__main__":
    main()
