"""knit-proxyd's iptables and nftables modes at scale, side by side, each figure beside an
anchor measured in the same run.

A real etcd + kube-apiserver on host loopback holds N Services (one TCP port each), each with
an EndpointSlice of 10 endpoints on another node. For each N and each mode (--modes, default
both), knit-proxyd starts in a fresh node namespace and is measured:

- full sync: the daemon's own metric, and the wall time from its start to the rules being in
  the kernel, against a bare load of exactly the rules it wrote into a fresh namespace
  (iptables: iptables-restore, the daemon's flavour, of iptables-save of its nat and filter
  tables; nftables: `nft -f` of `nft list table ip knit`); then one full sync at steady state
  (forced by changing the Node's zone) against a bare reload of the same rules over themselves
  (nftables: `flush table` and the listing, in one transaction);
- its resident memory (VmRSS of the interpreter);
- one-service changes (one endpoint of one EndpointSlice replaced): the partial sync's own
  metric against a bare load of the same change, rendered by the daemon's code
  (`iptables-restore --noflush`, or `nft -f` of the daemon's partial transaction, into the
  anchor namespace holding the same rules), and the latency from the PATCH returning to the
  new endpoint being in the kernel: polled from outside when a look is cheap
  (`iptables -S <chain>` / `nft list chain ip knit <chain>`), and by the daemon's last-sync
  timestamp (checked against the kernel afterwards);

and at the largest N:

- TCP connections per second (sequential connect + reset) from a client namespace to a
  ClusterIP (iptables: the one whose rule is the last service rule of KNIT-SERVICES; nftables:
  the same service, any one costs one verdict-map lookup), and to the backend directly through
  the same node, against the backend reached through a node namespace without any rules.

The run ends with every figure as measured, then a table comparing the modes per N with the
nftables mode's goals marked met or not: connections through a ClusterIP at the largest N at
least 80% of direct, a one-service change under 20 ms whose partial sync does not grow from
the smallest N to the largest (at most 1.5x), and full syncs at most 1.5x the bare `nft -f`.

`--flavour legacy` makes the node look like one whose kubelet uses iptables-legacy (kubelet's
hint chain), so the iptables mode detects and uses legacy; by default it detects nft, as on
any fresh node here. A first full sync that takes longer than --sync-timeout ends that size.

Run as root from the repository root (~15 minutes on a 2-core VM, 2 of them creating the
20,000 objects):
  .venv/bin/python -m bench.proxy_bench [--sizes 1000,10000] [--modes iptables,nftables]
      [--flavour nft|legacy] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import os
import pstats
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config

from deploy.lab.controlplane import ControlPlane, NetnsForward, start
from deploy.lab.kube import SERVICES, SLICES, Kube, endpoint, service_object, slice_object
from proxyd.iptables import render as iptables_render
from proxyd.iptables.chains import ServiceChains
from proxyd.iptables.restore import RuleSet, partial_script
from proxyd.model import Endpoint, NodeInfo, ServicePort, ServicePortName
from proxyd.nftables import render as nftables_render
from proxyd.nftables.kernel import CHAIN_LINE
from proxyd.nftables.transaction import TableState, full_transaction, partial_transaction
from proxyd.plan import FamilyContext, PortPlan, plan_port
from tests.conftest import ROOT, Netns, unique_name
from tests.integration.proxy_env import node_object

NODE = "bench-node"
REMOTE_NODE = "node-elsewhere"
CLUSTER_CIDR = "10.244.0.0/16"
PORT, TARGET_PORT = 80, 8080
ENDPOINTS = 10
SLICE_PORTS = [{"name": "", "port": TARGET_PORT, "protocol": "TCP"}]
CLIENT, CLIENT_GATEWAY = "10.244.200.2", "10.244.200.1"
BACKEND_GATEWAY = "10.244.201.1"
BACKENDS = [f"10.244.201.{host}" for host in range(2, 3 + ENDPOINTS)]
"""The target service's endpoints, and one more address for the direct connections."""
WORKERS = 16
METRICS = "http://127.0.0.1:10249/metrics"
FULL = "kubeproxy_sync_full_proxy_rules_duration_seconds"
PARTIAL = "kubeproxy_sync_partial_proxy_rules_duration_seconds"
LAST_SYNC = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
ZONE = "topology.kubernetes.io/zone"
LEGACY_HINT = "KUBE-IPTABLES-HINT"
NFT_TABLE = ("ip", nftables_render.TABLE)
OUTSIDE_POLL_LIMIT = 0.05
"""Seconds one look at the kernel may cost to be polled during a change (legacy: ~0.8 s at
10,000 services, holding the xtables lock the daemon's restore waits for)."""
FORCED_FULL_LIMIT = 120.0
"""No forced full sync at steady state when the first one took longer than this (seconds)."""
FULL_SYNC_GOAL = 1.5
"""nftables: a full sync costs at most this many bare `nft -f` of the same rules."""
CHANGE_GOAL = 0.02
"""nftables: seconds a one-service change may take."""
SIZE_GROWTH_GOAL = 1.5
"""nftables: a partial sync at the largest N costs at most this many at the smallest."""
CONNECTION_GOAL = 0.8
"""nftables: connections/s through a ClusterIP at the largest N, as a share of direct."""
CLUSTER_IP_RULE = re.compile(r'^-A KNIT-SERVICES .*--comment "default/([^:]+): cluster IP"')
T = TypeVar("T")
SERVER = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])), backlog=4096)
print("ready", flush=True)
while True:
    server.accept()[0].close()
"""
CLIENT_LOOP = """
import socket, struct, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
reset = struct.pack("ii", 1, 0)
count, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    with socket.socket() as sock:
        sock.settimeout(2)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, reset)
        sock.connect((host, port))
    count += 1
print(count / seconds)
"""


def poll(check: Callable[[], T], timeout: float, interval: float) -> T | None:
    """The first truthy result of check(), or None after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(interval)
    return None


def timed(fn: Callable[[], Any]) -> float:
    began = time.monotonic()
    fn()
    return time.monotonic() - began


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def secs(seconds: float) -> str:
    return f"{seconds:.2f} s"


def service_name(index: int) -> str:
    return f"svc-{index:05d}"


def fake_endpoints(index: int) -> list[dict[str, Any]]:
    """Pod IPs in 10.244.0.0-10.244.99.255, away from the client and the backend."""
    hosts = ((index * ENDPOINTS + j) % 25000 for j in range(ENDPOINTS))
    return [endpoint(f"10.244.{h // 250}.{h % 250 + 1}", REMOTE_NODE) for h in hosts]


def api_client(plane: ControlPlane) -> client.ApiClient:
    configuration = client.Configuration()
    config.load_kube_config(str(plane.kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = WORKERS
    return client.ApiClient(configuration)


def create_services(kube: Kube, indices: range) -> float:
    """Seconds to create a Service and its EndpointSlice for each index, in parallel."""

    def one(index: int) -> None:
        name = service_name(index)
        ports = [{"port": PORT, "targetPort": TARGET_PORT, "protocol": "TCP"}]
        kube.call("POST", SERVICES, service_object(name, ports))
        kube.call("POST", SLICES, slice_object(name, fake_endpoints(index), SLICE_PORTS))

    began = time.monotonic()
    pool = ThreadPoolExecutor(WORKERS)
    try:
        list(pool.map(one, indices))
    finally:
        pool.shutdown(cancel_futures=True)
    return time.monotonic() - began


@dataclass
class Namespaces:
    """Fresh network namespaces, each removed again."""

    made: list[Netns] = field(default_factory=list)

    def make(self, prefix: str) -> Netns:
        ns = Netns(unique_name(f"kpb-{prefix}"))
        subprocess.run(["ip", "netns", "add", ns.name], check=True)
        self.made.append(ns)
        ns.run("ip", "link", "set", "lo", "up")
        return ns

    def remove(self, ns: Netns) -> None:
        ns.remove()
        self.made.remove(ns)

    def close(self) -> None:
        for ns in reversed(self.made):
            ns.remove()
        self.made.clear()


@dataclass
class Daemon:
    """knit-proxyd in a node namespace."""

    ns: Netns
    process: subprocess.Popen[bytes]
    log: Path
    started: float
    """time.time() just before the launch."""

    @classmethod
    def start(
        cls, ns: Netns, mode: str, kubeconfig: Path, log: Path, profile: Path | None
    ) -> Daemon:
        argv = [sys.executable, *(["-m", "cProfile", "-o", str(profile)] if profile else [])]
        argv += ["-m", "proxyd", "--proxy-mode", mode, "--kubeconfig", str(kubeconfig)]
        argv += ["--hostname-override", NODE]
        argv += ["--cluster-cidr", CLUSTER_CIDR, "--metrics-bind-address", "127.0.0.1:10249"]
        started = time.time()
        with log.open("ab") as out:
            process = subprocess.Popen(
                ["ip", "netns", "exec", ns.name, *argv],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
        return cls(ns, process, log, started)

    def metrics(self) -> dict[str, float]:
        if self.process.poll() is not None:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"knit-proxyd exited with {self.process.returncode}:\n{tail}")
        body = self.ns.run("curl", "-sf", METRICS, check=False).stdout
        values = {}
        for line in body.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                values[key] = float(value)
        return values

    def wait_sync(
        self, kind: str, before: dict[str, float], timeout: float
    ) -> dict[str, float] | None:
        """The metrics once a sync of `kind` (FULL or PARTIAL) ended after `before`."""
        count = f"{kind}_count"
        return poll(
            lambda: (m := self.metrics()).get(count, 0) > before.get(count, 0) and m,
            timeout,
            0.1,
        )

    def memory_mib(self) -> tuple[float, float]:
        """(VmRSS, VmHWM); `ip netns exec` execs the interpreter, so the pid is the same."""
        assert b"proxyd" in Path(f"/proc/{self.process.pid}/cmdline").read_bytes()
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines())
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def spent(after: dict[str, float], before: dict[str, float], kind: str) -> float:
    return after[f"{kind}_sum"] - before.get(f"{kind}_sum", 0.0)


class Mode(ABC):
    """What differs between the modes knit-proxyd is measured in: how its rules are read
    back, loaded bare, looked up and changed."""

    name: str
    loader: str
    """The bare load, as the figures name it."""
    judged = False
    """The issue's goals are this mode's."""

    @abstractmethod
    def prepare(self, node: Netns) -> None:
        """Make the node look as this mode expects, before the daemon starts."""

    @abstractmethod
    def save(self, ns: Netns) -> str:
        """The rules the daemon wrote, as its bare load takes them."""

    @abstractmethod
    def load(self, ns: Netns, rules: str) -> float:
        """Seconds to load `rules` into ns."""

    @abstractmethod
    def reload(self, ns: Netns, rules: str) -> float:
        """Seconds to load `rules` over themselves."""

    @abstractmethod
    def apply(self, ns: Netns, change: str) -> float:
        """Seconds to load a change (from `change()`) over the rules ns holds."""

    @abstractmethod
    def chain(self, ns: Netns, chain: str) -> str:
        """One chain, listed."""

    @abstractmethod
    def cluster_chain(self, name: str) -> str:
        """The chain holding the endpoints of the service `name`."""

    @abstractmethod
    def change(self, ctx: FamilyContext, before: PortPlan, after: PortPlan) -> str:
        """The daemon's partial load taking one service port from `before` to `after`."""

    @abstractmethod
    def summary(self, saved: str) -> str:
        """How much the daemon wrote."""

    @abstractmethod
    def connection_target(self, saved: str, size: int) -> str:
        """The service to connect through."""

    @abstractmethod
    def dispatch(self, node: Netns, target: str) -> str:
        """How a new connection finds the target's rules."""


class Iptables(Mode):
    """One flavour of the IPv4 iptables binaries, run in namespaces."""

    name = "iptables"

    def __init__(self, flavour: str) -> None:
        self.flavour = flavour
        self.loader = f"iptables-{flavour}-restore"

    def prepare(self, node: Netns) -> None:
        if self.flavour == "legacy":
            node.run("iptables-legacy", "-t", "mangle", "-N", LEGACY_HINT)
        code = "from cni.firewall import detect_iptables_flavour as d; print(d())"
        detected = node.run(sys.executable, "-c", code).stdout.strip()
        assert detected == self.flavour, f"the node detects {detected}"

    def save(self, ns: Netns) -> str:
        save = f"iptables-{self.flavour}-save"
        return ns.run(save, "-t", "nat").stdout + ns.run(save, "-t", "filter").stdout

    def load(self, ns: Netns, rules: str) -> float:
        return self._restore(ns, rules)

    def reload(self, ns: Netns, rules: str) -> float:
        return self._restore(ns, rules)

    def apply(self, ns: Netns, change: str) -> float:
        return self._restore(ns, change, "--noflush")

    def _restore(self, ns: Netns, rules: str, *flags: str) -> float:
        binary = f"iptables-{self.flavour}-restore"
        return timed(lambda: ns.run(binary, "-w", "5", *flags, stdin=rules, timeout=3600))

    def chain(self, ns: Netns, chain: str) -> str:
        return ns.run(f"iptables-{self.flavour}", "-w", "5", "-t", "nat", "-S", chain).stdout

    def cluster_chain(self, name: str) -> str:
        return ServiceChains(ServicePortName("default", name, "", "TCP")).cluster

    def change(self, ctx: FamilyContext, before: PortPlan, after: PortPlan) -> str:
        def rules(plan: PortPlan) -> RuleSet:
            rendered = iptables_render.render_service(plan, ctx)
            return RuleSet(iptables_render.render_base(ctx), {plan.port.name: rendered})

        return partial_script(rules(before), rules(after), [after.port.name]).text()

    def summary(self, saved: str) -> str:
        rules = sum(1 for line in saved.splitlines() if line.startswith("-A "))
        chains = sum(1 for line in saved.splitlines() if line.startswith(":"))
        return f"{rules} rules in {chains} chains (nat + filter)"

    def connection_target(self, saved: str, size: int) -> str:
        order = service_order(saved)
        print(
            f"  KNIT-SERVICES holds {len(order)} cluster IP rules, in name order: "
            f"{'yes' if order == sorted(order) else 'no'}; the last is {order[-1]}'s"
        )
        return order[-1]

    def dispatch(self, node: Netns, target: str) -> str:
        order = service_order(self.save(node))
        return f"rule {order.index(target) + 1} of {len(order)}"


class Nftables(Mode):
    """The daemon's table `ip knit`, read and loaded with nft in namespaces."""

    name = "nftables"
    loader = "nft -f"
    judged = True

    def prepare(self, node: Netns) -> None:
        """Nothing: the mode does not depend on the node's iptables."""

    def save(self, ns: Netns) -> str:
        return ns.run("nft", "list", "table", *NFT_TABLE, timeout=600).stdout

    def load(self, ns: Netns, rules: str) -> float:
        return timed(lambda: ns.run("nft", "-f", "-", stdin=rules, timeout=3600))

    def reload(self, ns: Netns, rules: str) -> float:
        return self.load(ns, f"flush table {' '.join(NFT_TABLE)}\n{rules}")

    def apply(self, ns: Netns, change: str) -> float:
        return self.load(ns, change)

    def chain(self, ns: Netns, chain: str) -> str:
        return ns.run("nft", "list", "chain", *NFT_TABLE, chain).stdout

    def cluster_chain(self, name: str) -> str:
        return nftables_render.ServiceNames(ServicePortName("default", name, "", "TCP")).cluster

    def change(self, ctx: FamilyContext, before: PortPlan, after: PortPlan) -> str:
        name = after.port.name
        old = TableState(
            nftables_render.render_base(ctx),
            {name: nftables_render.render_service(before, ctx)},
        )
        full_transaction(ctx.family, old, set(), set())  # fills in the claims, as the daemon's
        new = old.copy()
        new.services[name] = nftables_render.render_service(after, ctx)
        return partial_transaction(ctx.family, old, new, [name])

    def summary(self, saved: str) -> str:
        chains = len(CHAIN_LINE.findall(saved))
        return f"{chains} chains in table {' '.join(NFT_TABLE)}"

    def connection_target(self, saved: str, size: int) -> str:
        return service_name(size - 1)

    def dispatch(self, node: Netns, target: str) -> str:
        return "one verdict-map lookup"


def service_order(saved: str) -> list[str]:
    """Service names in the order of their cluster IP rules in KNIT-SERVICES."""
    return [m.group(1) for line in saved.splitlines() if (m := CLUSTER_IP_RULE.match(line))]


class OneServiceChange:
    """Replaces one endpoint of one service's slice at a time: in the API, and (rendered by the
    daemon's code) as the mode's partial load of the same change."""

    def __init__(self, kube: Kube, mode: Mode, index: int, fresh: Iterator[str]) -> None:
        self.kube = kube
        self.mode = mode
        self.fresh = fresh
        self.name = service_name(index)
        self.chain = mode.cluster_chain(self.name)
        self.endpoints = kube.call("GET", f"{SLICES}/{self.name}-ipv4")["endpoints"]
        spec = kube.call("GET", f"{SERVICES}/{self.name}")["spec"]
        port_name = ServicePortName("default", self.name, "", "TCP")
        self.port = ServicePort(port_name, (spec["clusterIP"],), PORT)
        self.ctx = FamilyContext(family=4, node=NodeInfo(NODE), cluster_cidr=CLUSTER_CIDR)
        self.changes = 0

    def _plan(self) -> PortPlan:
        endpoints = sorted(
            (
                Endpoint(e["addresses"][0], TARGET_PORT, node_name=REMOTE_NODE)
                for e in self.endpoints
            ),
            key=lambda e: e.ip,
        )
        plan = plan_port(self.port, tuple(endpoints), self.ctx)
        assert plan is not None
        return plan

    def apply(self) -> tuple[str, str]:
        """Patch the slice; return (the new endpoint as the rules name it, the change)."""
        before = self._plan()
        new_ip = next(self.fresh)
        self.endpoints[self.changes % ENDPOINTS] = endpoint(new_ip, REMOTE_NODE)
        self.changes += 1
        script = self.mode.change(self.ctx, before, self._plan())
        self.kube.patch(f"{SLICES}/{self.name}-ipv4", {"endpoints": self.endpoints})
        return f"{new_ip}:{TARGET_PORT}", script


def veth(node: Netns, name: str, pod: Netns, gateway: str, addresses: list[str]) -> None:
    """A veth from the node (NAME, holding the gateway) to the pod (eth0, the addresses)."""
    node.run("ip", "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", pod.name)
    node.run("ip", "addr", "add", f"{gateway}/24", "dev", name)
    node.run("ip", "link", "set", name, "up")
    for address in addresses:
        pod.run("ip", "addr", "add", f"{address}/24", "dev", "eth0")
    pod.run("ip", "link", "set", "eth0", "up")
    pod.run("ip", "route", "add", "default", "via", gateway)


@dataclass(frozen=True)
class Row:
    mode: str
    size: int
    figure: str
    knit: str
    anchor: str = ""
    ratio: str = ""
    goal: str = ""


def columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Rows as a table of left-aligned columns under a header."""
    cells = [header, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


@dataclass
class Report:
    """Figures as measured: printed at once, and as tables at the end."""

    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        extra = "".join(
            f" | {label} {value}"
            for label, value in (("anchor", row.anchor), ("ratio", row.ratio), ("goal", row.goal))
            if value
        )
        print(f"  {row.figure}: {row.knit}{extra}", flush=True)

    def table(self) -> str:
        header = ("mode", "N", "figure", "knit-proxyd", "anchor", "ratio", "goal")
        return columns(
            header,
            [(r.mode, str(r.size), r.figure, r.knit, r.anchor, r.ratio, r.goal) for r in self.rows],
        )

    def comparison(self, modes: list[str]) -> str:
        """One line per N and figure: each mode's figure with its ratio to its anchor, and
        the judged mode's goal."""
        cells: dict[tuple[int, str], dict[str, Row]] = {}
        for row in self.rows:
            if row.mode in modes:
                cells.setdefault((row.size, row.figure), {})[row.mode] = row
        lines = []
        for (size, figure), by_mode in sorted(cells.items(), key=lambda item: item[0][0]):
            values = (cell(by_mode.get(mode)) for mode in modes)
            goal = next((r.goal for r in by_mode.values() if r.goal), "")
            lines.append((str(size), figure, *values, goal))
        return columns(("N", "figure", *modes, "goal (nftables)"), lines)


def cell(row: Row | None) -> str:
    if row is None:
        return ""
    return f"{row.knit} ({row.ratio})" if row.ratio else row.knit


def ratio(value: float, anchor: float) -> str:
    return f"{value / anchor:.2f}x"


class Bench:
    def __init__(
        self, options: argparse.Namespace, plane: ControlPlane, kube: Kube, work: Path
    ) -> None:
        self.options = options
        self.plane = plane
        self.kube = kube
        self.work = work
        self.namespaces = Namespaces()
        self.report = Report()
        self.repeats = 1 if options.quick else 3
        self.fresh = (f"10.244.150.{host}" for host in itertools.count(1))
        """Addresses no endpoint had, for one-service changes."""
        self.partial: dict[str, dict[int, float]] = {}
        """mode -> N -> median partial sync of one-service changes."""

    def add(
        self,
        mode: Mode,
        size: int,
        figure: str,
        knit: str,
        anchor: str = "",
        ratio: str = "",
        goal: tuple[str, bool] | None = None,
    ) -> None:
        """Report a figure; `goal` (its text, whether it is met) counts in a judged mode."""
        judged = f"{goal[0]}: {'met' if goal[1] else 'NOT met'}" if goal and mode.judged else ""
        self.report.add(Row(mode.name, size, figure, knit, anchor, ratio, judged))

    def size(self, size: int, mode: Mode, largest: bool) -> None:
        print(f"\n{size} services, knit-proxyd in {mode.name} mode ({mode.loader}):", flush=True)
        tag = f"{mode.name}-{size}"
        profile = self.work / f"proxyd-{tag}.prof" if self.options.profile else None
        with ExitStack() as stack:
            node = self.namespaces.make("node")
            stack.callback(self.namespaces.remove, node)
            mode.prepare(node)
            forward = NetnsForward(node.name, self.plane.port)
            stack.callback(forward.stop)
            kubeconfig = self.plane.write_kubeconfig(
                self.work / f"kubeconfig-{tag}", forward.listen_port
            )
            log = self.work / f"proxyd-{tag}.log"
            daemon = Daemon.start(node, mode.name, kubeconfig, log, profile)
            stack.callback(daemon.stop)
            self.measure(size, mode, largest, daemon, stack)
        if profile is not None:
            print(f"  the daemon's main thread, under cProfile ({profile}):")
            pstats.Stats(str(profile)).sort_stats("cumulative").print_stats("proxyd/", 25)

    def measure(
        self, size: int, mode: Mode, largest: bool, daemon: Daemon, stack: ExitStack
    ) -> None:
        synced = daemon.wait_sync(FULL, {}, self.options.sync_timeout)
        if synced is None:
            limit = f"> {self.options.sync_timeout:.0f} s"
            self.add(mode, size, "full sync at start (metric)", f"not done, {limit}")
            return
        full = spent(synced, {}, FULL)
        rss, _ = daemon.memory_mib()
        self.add(mode, size, "daemon memory after start (VmRSS)", f"{rss:.0f} MiB")
        saved = mode.save(daemon.ns)
        wall = synced[LAST_SYNC] - daemon.started
        anchor = self.bare_loads(size, mode, saved, full, wall)
        stack.callback(self.namespaces.remove, anchor)
        if full < FORCED_FULL_LIMIT:
            self.forced_full_sync(size, mode, daemon, anchor, saved)
        else:
            print(f"  no forced full sync: the first took {secs(full)}")
        self.one_service_changes(size, mode, daemon, anchor)
        if largest:
            self.connection_rate(size, mode, daemon, saved)
        rss, hwm = daemon.memory_mib()
        self.add(mode, size, "daemon memory at the end (VmRSS/peak)", f"{rss:.0f}/{hwm:.0f} MiB")

    def bare_loads(self, size: int, mode: Mode, saved: str, full: float, wall: float) -> Netns:
        """Time loading `saved` into fresh namespaces; return the last one, left loaded."""
        times = []
        for repeat in range(self.repeats):
            ns = self.namespaces.make("anchor")
            times.append(mode.load(ns, saved))
            if repeat < self.repeats - 1:
                self.namespaces.remove(ns)
        bare = statistics.median(times)
        what = f"bare {mode.loader} {secs(bare)}"
        print(f"  the daemon wrote {mode.summary(saved)}")
        goal = (f"<= {FULL_SYNC_GOAL}x", full / bare <= FULL_SYNC_GOAL)
        figure = "full sync at start (metric)"
        self.add(mode, size, figure, secs(full), what, ratio(full, bare), goal)
        figure = "start to rules in kernel (wall)"
        self.add(mode, size, figure, secs(wall), what, ratio(wall, bare))
        return ns

    def forced_full_sync(
        self, size: int, mode: Mode, daemon: Daemon, anchor: Netns, saved: str
    ) -> None:
        before = daemon.metrics()
        zone = f"zone-{size}-{mode.name}"
        self.kube.patch(f"/api/v1/nodes/{NODE}", {"metadata": {"labels": {ZONE: zone}}})
        after = daemon.wait_sync(FULL, before, self.options.sync_timeout)
        bare = mode.reload(anchor, saved)
        what = f"bare {mode.loader} over the same rules {secs(bare)}"
        figure = "full sync at steady state (metric)"
        if after is None:
            self.add(mode, size, figure, f"not done, > {self.options.sync_timeout:.0f} s", what)
            return
        forced = spent(after, before, FULL)
        goal = (f"<= {FULL_SYNC_GOAL}x", forced / bare <= FULL_SYNC_GOAL)
        self.add(mode, size, figure, secs(forced), what, ratio(forced, bare), goal)

    def one_service_changes(self, size: int, mode: Mode, daemon: Daemon, anchor: Netns) -> None:
        node = daemon.ns
        change = OneServiceChange(self.kube, mode, size // 2, self.fresh)

        def programmed(target: str) -> bool:
            return target in mode.chain(node, change.chain)

        poll_cost = timed(lambda: programmed(""))
        outside = poll_cost < OUTSIDE_POLL_LIMIT
        syncs, bares = [], []
        latencies: dict[str, list[float]] = {"polled from outside": [], "daemon's timestamp": []}
        for _ in range(5 if self.options.quick else 10):
            time.sleep(1.0)  # the daemon's default --min-sync-period, since the last sync
            before = daemon.metrics()
            target, script = change.apply()
            patched, patched_at = time.monotonic(), time.time()
            if outside:
                if poll(lambda t=target: programmed(t), 60, 0.005) is None:
                    raise RuntimeError(f"{target} not in {change.chain} 60 s after the PATCH")
                latencies["polled from outside"].append(time.monotonic() - patched)
            after = daemon.wait_sync(PARTIAL, before, 60)
            assert after is not None and programmed(target), f"{target} was not programmed"
            latencies["daemon's timestamp"].append(after[LAST_SYNC] - patched_at)
            syncs.append(spent(after, before, PARTIAL))
            bares.append(mode.apply(anchor, script))
        bare = statistics.median(bares)
        what = f"bare {mode.loader} of the change {ms(bare)}"
        self.partial.setdefault(mode.name, {})[size] = statistics.median(syncs)
        goal = f"< {ms(CHANGE_GOAL)}"
        for label, values in (("median", statistics.median), ("max", max)):
            sync = values(syncs)
            self.add(
                mode,
                size,
                f"one-service change: partial sync ({label}, metric)",
                ms(sync),
                what,
                ratio(sync, bare),
                (goal, sync < CHANGE_GOAL) if label == "median" else None,
            )
        for how, samples in latencies.items():
            for label, values in (("median", statistics.median), ("max", max)):
                if samples:
                    latency = values(samples)
                    self.add(
                        mode,
                        size,
                        f"one-service change: PATCH to rules in kernel ({label}, {how})",
                        ms(latency),
                        goal=(goal, latency < CHANGE_GOAL) if label == "median" else None,
                    )
        look = f"one look at {change.chain} costs {ms(poll_cost)}"
        print(f"  ({look}{'' if outside else ', too much to poll without disturbing the daemon'})")

    def size_growth(self, sizes: list[int], modes: list[Mode]) -> None:
        """The partial sync at the largest N against the smallest's, for each mode."""
        for mode in modes:
            medians = self.partial.get(mode.name, {})
            smallest, largest = sizes[0], sizes[-1]
            if smallest != largest and smallest in medians and largest in medians:
                growth = medians[largest] / medians[smallest]
                self.add(
                    mode,
                    largest,
                    f"one-service change: partial sync (median) against N={smallest}",
                    ms(medians[largest]),
                    f"N={smallest}: {ms(medians[smallest])}",
                    ratio(medians[largest], medians[smallest]),
                    (f"<= {SIZE_GROWTH_GOAL}x", growth <= SIZE_GROWTH_GOAL),
                )

    def connection_rate(self, size: int, mode: Mode, daemon: Daemon, saved: str) -> None:
        node = daemon.ns
        target = mode.connection_target(saved, size)
        client_ns = self.attach(node)
        plain_client = self.attach(self.namespaces.make("plain"))
        slice_endpoints = [endpoint(ip, REMOTE_NODE) for ip in BACKENDS[:ENDPOINTS]]
        self.kube.patch(f"{SLICES}/{target}-ipv4", {"endpoints": slice_endpoints})
        chain = mode.cluster_chain(target)
        if poll(lambda: BACKENDS[0] in mode.chain(node, chain), 60, 0.05) is None:
            raise RuntimeError(f"the backends did not reach {chain}")
        dispatch = mode.dispatch(node, target)
        cluster_ip = self.kube.call("GET", f"{SERVICES}/{target}")["spec"]["clusterIP"]
        loads = {
            "service": (client_ns, cluster_ip, PORT),
            "direct": (client_ns, BACKENDS[-1], TARGET_PORT),
            "plain": (plain_client, BACKENDS[-1], TARGET_PORT),
        }
        seconds = 1.0 if self.options.quick else 2.0
        rates: dict[str, list[float]] = {kind: [] for kind in loads}
        for _ in range(self.repeats):
            for kind, (ns, host, port) in loads.items():
                out = ns.run(sys.executable, "-c", CLIENT_LOOP, host, str(port), str(seconds))
                rates[kind].append(float(out.stdout))
        rate = {kind: statistics.median(values) for kind, values in rates.items()}
        plain = f"direct, through a node without rules {rate['plain']:.0f}/s"
        share = rate["service"] / rate["plain"]
        self.add(
            mode,
            size,
            "TCP connections/s via ClusterIP",
            f"{rate['service']:.0f}/s, {dispatch}",
            plain,
            ratio(rate["service"], rate["plain"]),
            (f">= {CONNECTION_GOAL:.0%} of direct", share >= CONNECTION_GOAL),
        )
        self.add(
            mode,
            size,
            "TCP connections/s direct to the backend, through this node",
            f"{rate['direct']:.0f}/s",
            plain,
            ratio(rate["direct"], rate["plain"]),
        )

    def attach(self, node: Netns) -> Netns:
        """A client and a backend (serving on all BACKENDS) routed through node: the client."""
        client_ns, backend = self.namespaces.make("client"), self.namespaces.make("backend")
        veth(node, "cl0", client_ns, CLIENT_GATEWAY, [CLIENT])
        veth(node, "be0", backend, BACKEND_GATEWAY, BACKENDS)
        node.run("sysctl", "-qw", "net.ipv4.ip_forward=1")
        server = subprocess.Popen(
            ["ip", "netns", "exec", backend.name, sys.executable, "-c", SERVER, str(TARGET_PORT)],
            stdout=subprocess.PIPE,
            text=True,
        )
        backend.servers.append(server)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        return client_ns

    def close(self) -> None:
        self.namespaces.close()


MODES = ("iptables", "nftables")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000", help="numbers of services, e.g. 1000")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="proxy modes to measure, e.g. nftables"
    )
    parser.add_argument("--flavour", choices=("nft", "legacy"), default="nft")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter loads")
    parser.add_argument(
        "--sync-timeout", type=float, default=300.0, help="seconds allowed for a full sync"
    )
    parser.add_argument(
        "--profile", action="store_true", help="run the daemon under cProfile, print its top"
    )
    options = parser.parse_args()
    sizes = sorted(int(size) for size in options.sizes.split(","))
    names = options.modes.split(",")
    if unknown := set(names) - set(MODES):
        parser.error(f"unknown modes {', '.join(sorted(unknown))} (one of {', '.join(MODES)})")
    available: dict[str, Mode] = {"iptables": Iptables(options.flavour), "nftables": Nftables()}
    modes = [available[name] for name in names]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="knit-proxy-bench-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        plane = start(work / "controlplane")
        stack.callback(plane.stop)
        api = api_client(plane)
        stack.callback(api.close)
        kube = Kube(api)
        kube.call("POST", "/api/v1/nodes", node_object(NODE))
        bench = Bench(options, plane, kube, work)
        stack.callback(bench.close)
        created = 0
        for size in sizes:
            took = create_services(kube, range(created, size))
            objects = 2 * (size - created)
            print(f"\ncreated {objects} objects in {secs(took)} ({objects / took:.0f}/s)")
            figure = f"creating {objects} objects via the API"
            bench.report.add(Row("api", size, figure, secs(took)))
            created = size
            for mode in modes:
                bench.size(size, mode, size == sizes[-1])
        bench.size_growth(sizes, modes)
    revision = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    print(f"\n{bench.report.table()}\n")
    print(f"{bench.report.comparison([mode.name for mode in modes])}\n")
    print(f"command: {shlex.join(sys.orig_argv)} (at {revision})")


if __name__ == "__main__":
    main()
