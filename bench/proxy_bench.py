"""knit-proxyd's iptables mode at scale, each figure beside an anchor measured in the same run.

A real etcd + kube-apiserver on host loopback holds N Services (one TCP port each), each with
an EndpointSlice of 10 endpoints on another node. For each N, knit-proxyd starts in a fresh
node namespace and is measured:

- full sync: the daemon's own metric, and the wall time from its start to the rules being in
  the kernel, against a bare iptables-restore (the daemon's flavour) of exactly the rules it
  wrote (iptables-save of its nat and filter tables) into a fresh namespace; then one full
  sync at steady state (forced by changing the Node's zone) against a bare restore of the
  same rules over themselves;
- its resident memory (VmRSS of the interpreter);

and at the largest N:

- one-service changes (one endpoint of one EndpointSlice replaced): the partial sync's own
  metric against a bare `iptables-restore --noflush` of the same change (rendered by the
  daemon's code), and the latency from the PATCH returning to the new endpoint being in the
  kernel: polled from outside when a look is cheap (nft), and by the daemon's last-sync
  timestamp (checked against the kernel afterwards);
- TCP connections per second (sequential connect + reset) from a client namespace to a
  ClusterIP whose rule is the last service rule of KNIT-SERVICES, and to the backend directly
  through the same node (every new connection crosses KNIT-SERVICES), against the backend
  reached through a node namespace without any rules.

`--flavour legacy` makes the node look like one whose kubelet uses iptables-legacy (kubelet's
hint chain), so the daemon detects and uses legacy; by default it detects nft, as on any fresh
node here. A first full sync that takes longer than --sync-timeout ends that size.

Run as root from the repository root (~5 minutes on a 2-core VM, 2 of them creating the 20,000
objects):
  .venv/bin/python -m bench.proxy_bench [--sizes 1000,10000] [--flavour nft|legacy] [--quick]
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config

from deploy.lab.controlplane import ControlPlane, NetnsForward, start
from deploy.lab.kube import SERVICES, SLICES, Kube, endpoint, service_object, slice_object
from proxyd.iptables.chains import ServiceChains
from proxyd.iptables.render import render_base, render_service
from proxyd.iptables.restore import RuleSet, partial_script
from proxyd.model import Endpoint, NodeInfo, ServicePort, ServicePortName
from proxyd.plan import FamilyContext, plan_port
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
OUTSIDE_POLL_LIMIT = 0.05
"""Seconds one look at the kernel may cost to be polled during a change (legacy: ~0.8 s at
10,000 services, holding the xtables lock the daemon's restore waits for)."""
FORCED_FULL_LIMIT = 120.0
"""No forced full sync at steady state when the first one took longer than this (seconds)."""
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
    def start(cls, ns: Netns, kubeconfig: Path, log: Path, profile: Path | None) -> Daemon:
        argv = [sys.executable, *(["-m", "cProfile", "-o", str(profile)] if profile else [])]
        argv += ["-m", "proxyd", "--kubeconfig", str(kubeconfig), "--hostname-override", NODE]
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


@dataclass(frozen=True)
class Iptables:
    """One flavour of the IPv4 iptables binaries, run in namespaces."""

    flavour: str

    def save(self, ns: Netns) -> str:
        save = f"iptables-{self.flavour}-save"
        return ns.run(save, "-t", "nat").stdout + ns.run(save, "-t", "filter").stdout

    def restore(self, ns: Netns, rules: str, *flags: str) -> float:
        binary = f"iptables-{self.flavour}-restore"
        return timed(lambda: ns.run(binary, "-w", "5", *flags, stdin=rules, timeout=3600))

    def chain(self, ns: Netns, chain: str) -> str:
        return ns.run(f"iptables-{self.flavour}", "-w", "5", "-t", "nat", "-S", chain).stdout


def detected_flavour(ns: Netns) -> str:
    code = "from cni.firewall import detect_iptables_flavour as d; print(d())"
    return ns.run(sys.executable, "-c", code).stdout.strip()


def service_order(saved: str) -> list[str]:
    """Service names in the order of their cluster IP rules in KNIT-SERVICES."""
    return [m.group(1) for line in saved.splitlines() if (m := CLUSTER_IP_RULE.match(line))]


def cluster_chain(name: str) -> str:
    return ServiceChains(ServicePortName("default", name, "", "TCP")).cluster


class OneServiceChange:
    """Replaces one endpoint of one service's slice at a time: in the API, and (rendered by the
    daemon's code) as the iptables-restore --noflush script of the same change."""

    def __init__(self, kube: Kube, index: int) -> None:
        self.kube = kube
        self.name = service_name(index)
        self.chain = cluster_chain(self.name)
        self.endpoints = fake_endpoints(index)
        spec = kube.call("GET", f"{SERVICES}/{self.name}")["spec"]
        port_name = ServicePortName("default", self.name, "", "TCP")
        self.port = ServicePort(port_name, (spec["clusterIP"],), PORT)
        self.ctx = FamilyContext(family=4, node=NodeInfo(NODE), cluster_cidr=CLUSTER_CIDR)
        self.changes = 0

    def _rules(self) -> RuleSet:
        endpoints = sorted(
            (
                Endpoint(e["addresses"][0], TARGET_PORT, node_name=REMOTE_NODE)
                for e in self.endpoints
            ),
            key=lambda e: e.ip,
        )
        plan = plan_port(self.port, tuple(endpoints), self.ctx)
        assert plan is not None
        rendered = render_service(plan, self.ctx)
        return RuleSet(render_base(self.ctx), {self.port.name: rendered})

    def apply(self) -> tuple[str, str]:
        """Patch the slice; return (the new endpoint as the rules name it, the script)."""
        before = self._rules()
        new_ip = f"10.244.150.{self.changes + 1}"
        self.endpoints[self.changes % ENDPOINTS] = endpoint(new_ip, REMOTE_NODE)
        self.changes += 1
        script = partial_script(before, self._rules(), [self.port.name]).text()
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


@dataclass
class Report:
    """Figures as measured: printed at once, and as a table at the end."""

    rows: list[tuple[str, str, str, str, str]] = field(default_factory=list)

    def add(
        self, figure: str, knit: str, anchor: str = "", ratio: str = "", goal: str = ""
    ) -> None:
        self.rows.append((figure, knit, anchor, ratio, goal))
        extra = "".join(
            f" | {label} {value}"
            for label, value in (("anchor", anchor), ("ratio", ratio), ("goal", goal))
            if value
        )
        print(f"  {figure}: {knit}{extra}", flush=True)

    def table(self) -> str:
        header = ("figure", "knit-proxyd", "anchor", "ratio", "goal")
        rows = [header, *self.rows]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = [
            " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        lines.insert(1, "-+-".join("-" * w for w in widths))
        return "\n".join(line.rstrip() for line in lines)


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
        self.iptables = Iptables(options.flavour)
        self.namespaces = Namespaces()
        self.report = Report()
        self.repeats = 1 if options.quick else 3

    def size(self, size: int, largest: bool) -> None:
        print(f"\n{size} services, knit-proxyd with iptables-{self.iptables.flavour}:", flush=True)
        profile = self.work / f"proxyd-{size}.prof" if self.options.profile else None
        with ExitStack() as stack:
            node = self.namespaces.make("node")
            stack.callback(self.namespaces.remove, node)
            if self.iptables.flavour == "legacy":
                node.run("iptables-legacy", "-t", "mangle", "-N", LEGACY_HINT)
            detected = detected_flavour(node)
            assert detected == self.iptables.flavour, f"the node detects {detected}"
            forward = NetnsForward(node.name, self.plane.port)
            stack.callback(forward.stop)
            kubeconfig = self.plane.write_kubeconfig(
                self.work / f"kubeconfig-{size}", forward.listen_port
            )
            daemon = Daemon.start(node, kubeconfig, self.work / f"proxyd-{size}.log", profile)
            stack.callback(daemon.stop)
            self.measure(size, largest, daemon, stack)
        if profile is not None:
            print(f"  the daemon's main thread, under cProfile ({profile}):")
            pstats.Stats(str(profile)).sort_stats("cumulative").print_stats("proxyd/", 25)

    def measure(self, size: int, largest: bool, daemon: Daemon, stack: ExitStack) -> None:
        synced = daemon.wait_sync(FULL, {}, self.options.sync_timeout)
        if synced is None:
            limit = f"> {self.options.sync_timeout:.0f} s"
            self.report.add(f"N={size} full sync at start (metric)", f"not done, {limit}")
            return
        full = spent(synced, {}, FULL)
        rss, _ = daemon.memory_mib()
        self.report.add(f"N={size} daemon memory after start (VmRSS)", f"{rss:.0f} MiB")
        saved = self.iptables.save(daemon.ns)
        anchor = self.bare_restores(size, saved, full, synced[LAST_SYNC] - daemon.started)
        stack.callback(self.namespaces.remove, anchor)
        if full < FORCED_FULL_LIMIT:
            self.forced_full_sync(size, daemon, anchor, saved)
        else:
            print(f"  no forced full sync: the first took {secs(full)}")
        if largest:
            self.one_service_changes(size, daemon, anchor)
            self.connection_rate(size, daemon, saved)
        rss, hwm = daemon.memory_mib()
        self.report.add(
            f"N={size} daemon memory at the end (VmRSS/peak)", f"{rss:.0f}/{hwm:.0f} MiB"
        )

    def bare_restores(self, size: int, saved: str, full: float, wall: float) -> Netns:
        """Time loading `saved` into fresh namespaces; return the last one, left loaded."""
        rules = sum(1 for line in saved.splitlines() if line.startswith("-A "))
        chains = sum(1 for line in saved.splitlines() if line.startswith(":"))
        times = []
        for repeat in range(self.repeats):
            ns = self.namespaces.make("anchor")
            times.append(self.iptables.restore(ns, saved))
            if repeat < self.repeats - 1:
                self.namespaces.remove(ns)
        bare = statistics.median(times)
        what = f"bare iptables-{self.iptables.flavour}-restore {secs(bare)}"
        print(f"  the daemon wrote {rules} rules in {chains} chains (nat + filter)")
        goal = "<= 1.5x"
        self.report.add(
            f"N={size} full sync at start (metric)", secs(full), what, ratio(full, bare), goal
        )
        self.report.add(
            f"N={size} start to rules in kernel (wall)", secs(wall), what, ratio(wall, bare)
        )
        return ns

    def forced_full_sync(self, size: int, daemon: Daemon, anchor: Netns, saved: str) -> None:
        before = daemon.metrics()
        self.kube.patch(f"/api/v1/nodes/{NODE}", {"metadata": {"labels": {ZONE: f"zone-{size}"}}})
        after = daemon.wait_sync(FULL, before, self.options.sync_timeout)
        bare = self.iptables.restore(anchor, saved)
        what = f"bare restore over the same rules {secs(bare)}"
        figure = f"N={size} full sync at steady state (metric)"
        if after is None:
            self.report.add(figure, f"not done, > {self.options.sync_timeout:.0f} s", what)
            return
        forced = spent(after, before, FULL)
        self.report.add(figure, secs(forced), what, ratio(forced, bare), "<= 1.5x")

    def one_service_changes(self, size: int, daemon: Daemon, anchor: Netns) -> None:
        node = daemon.ns
        change = OneServiceChange(self.kube, size // 2)

        def programmed(target: str) -> bool:
            return target in self.iptables.chain(node, change.chain)

        poll_cost = timed(lambda: programmed(""))
        outside = poll_cost < OUTSIDE_POLL_LIMIT
        syncs, bares = [], []
        latencies: dict[str, list[float]] = {"polled from outside": [], "daemon's timestamp": []}
        for _ in range(5 if self.options.quick else 10):
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
            bares.append(self.iptables.restore(anchor, script, "--noflush"))
            time.sleep(1.0)  # the daemon's default --min-sync-period
        bare = statistics.median(bares)
        what = f"bare restore --noflush of the change {ms(bare)}"
        for label, values in (("median", statistics.median), ("max", max)):
            sync = values(syncs)
            self.report.add(
                f"N={size} one-service change: partial sync ({label}, metric)",
                ms(sync),
                what,
                ratio(sync, bare),
            )
        for how, samples in latencies.items():
            for label, values in (("median", statistics.median), ("max", max)):
                if samples:
                    self.report.add(
                        f"N={size} one-service change: PATCH to rules in kernel ({label}, {how})",
                        ms(values(samples)),
                        goal="< 100 ms",
                    )
        look = f"one `iptables -S {change.chain}` costs {ms(poll_cost)}"
        print(f"  ({look}{'' if outside else ', too much to poll without disturbing the daemon'})")

    def connection_rate(self, size: int, daemon: Daemon, saved: str) -> None:
        node = daemon.ns
        order = service_order(saved)
        target = order[-1]
        print(
            f"  KNIT-SERVICES holds {len(order)} cluster IP rules, in name order: "
            f"{'yes' if order == sorted(order) else 'no'}; the last is {target}'s"
        )
        client_ns = self.attach(node)
        plain_client = self.attach(self.namespaces.make("plain"))
        slice_endpoints = [endpoint(ip, REMOTE_NODE) for ip in BACKENDS[:ENDPOINTS]]
        self.kube.patch(f"{SLICES}/{target}-ipv4", {"endpoints": slice_endpoints})
        chain = cluster_chain(target)
        if poll(lambda: BACKENDS[0] in self.iptables.chain(node, chain), 60, 0.05) is None:
            raise RuntimeError(f"the backends did not reach {chain}")
        position = service_order(self.iptables.save(node)).index(target) + 1
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
        for figure, kind in (
            (f"via ClusterIP (rule {position} of {len(order)})", "service"),
            ("direct to the backend, through this node", "direct"),
        ):
            self.report.add(
                f"N={size} TCP connections/s {figure}",
                f"{rate[kind]:.0f}/s",
                plain,
                ratio(rate[kind], rate["plain"]),
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000", help="numbers of services, e.g. 1000")
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
            bench.report.add(f"N={size} creating {objects} objects via the API", secs(took))
            created = size
            bench.size(size, size == sizes[-1])
    revision = subprocess.run(
        ["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    print(f"\n{bench.report.table()}\n\ncommand: {shlex.join(sys.orig_argv)} (at {revision})")


if __name__ == "__main__":
    main()
