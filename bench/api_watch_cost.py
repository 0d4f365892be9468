"""What knit-proxyd's watches cost the API server, beside kube-proxy's, and what the pods they
hold cost each daemon.

Every knit-proxyd with NetworkPolicy on watches every Pod, Namespace, NetworkPolicy and
ClusterNetworkPolicy (and every Node) in the cluster; kube-proxy watches Services,
EndpointSlices and its own Node. This bench measures both kinds of watcher against a real
etcd + kube-apiserver on host loopback (no node, no namespace of its own):

- the cluster: --pods pods (status Running with a pod IP, written through the status
  subresource as kubelet would) in --namespaces namespaces, on Nodes of --pods-per-node pods
  each, --services Services of 10 endpoints with their EndpointSlices, one NetworkPolicy per
  namespace, and the ClusterNetworkPolicy CRD installed;
- the watchers: for each N of --watchers, N processes of bench.watch_only, each the daemon's
  own reflectors feeding the state the daemon feeds: first N of kube-proxy's kind (Services,
  EndpointSlices, own Node), then N of knit's kind (all the daemon watches). Each phase
  starts its watchers, waits for their first lists, and measures;
- the kube-apiserver process (from /proc/PID/stat and status): its CPU seconds and peak
  memory (VmHWM, reset before) over the watchers' first lists; its CPU over --idle seconds
  with them connected, per minute; its VmRSS before and after; its CPU over --changes pod
  changes (a label PATCH each, at --rate a second) until every watcher heard them, and over
  as many EndpointSlice changes, each less its idle CPU over the same time; the watch-event
  bytes it encoded (apiserver_watch_events_sizes) and the watchers' received bytes (rchar of
  /proc/PID/io: the TLS stream) per change; and at the phase's end, its live Go heap
  (go_gc_heap_live_bytes: as its last collection found it, the churns having made it
  collect) and its goroutines;
- the watchers themselves: VmRSS after start (imports, client), after their first lists
  and the peak (VmHWM), and their sockets; and, in this process, the bytes the policy state
  holds per pod (tracemalloc, as bench.proxy_fixed_cost measures the proxy's caches).

A phase of no watchers first gives the API server's own cost of the same idle time and
changes; per watcher figures are a phase's minus that, divided by N, and the least-squares
slope over every N (that of no watchers included), which the largest weighs most. Each
figure of knit's kind is printed beside kube-proxy's kind at the same N, with the ratio; every
figure goes, with its command, commit and machine, to
docs/results/<date>-api-watch-cost[-variant].json.

Run as root from the repository root (~10 minutes with the defaults, its 50 watcher
processes of knit's kind taking ~5 GiB; ~3 minutes with `--pods 1000 --watchers 1,2
--changes 100`):
  .venv/bin/python -m bench.api_watch_cost [--pods 10000] [--watchers 1,10,50] [--changes 1000]
"""

from __future__ import annotations

import argparse
import gc
import ipaddress
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from kubernetes.client import ApiClient

from bench import record
from bench.proxy_cluster import SliceChange, bench_api, create_services, service_name
from bench.watch_only import memory_kib
from deploy.lab.controlplane import ControlPlane
from deploy.lab.kube import Kube, node_object, pod_object
from deploy.lab.paths import ROOT
from deploy.lab.process import exit_on_termination
from proxyd import kubeapi, watch
from proxyd.policy.model import pod_essentials
from proxyd.policy.state import PolicyState

CRD = ROOT / "deploy" / "kubernetes" / "clusternetworkpolicies.yaml"
KINDS = ("kube-proxy", "knit")
"""In the order each N measures them: the smaller first, so that the API server's memory a
phase leaves behind is the larger's."""
WORKERS = 16
TICK = os.sysconf("SC_CLK_TCK")
SETTLE = 2.0
"""Seconds after the first lists, and after each churn is heard, before the next window."""
DELIVERY_TIMEOUT = 180.0
WATCH_METRICS = ("apiserver_watch_events_total", "apiserver_watch_events_sizes")
LIVE_HEAP, GOROUTINES = "go_gc_heap_live_bytes", "go_goroutines"
SAMPLE = re.compile(r"^([a-z_:]+)(?:\{(.*)\})? (\S+)$")
LABEL = re.compile(r'(\w+)="([^"]*)"')
POD_RESOURCE, SLICE_RESOURCE = "pods", "endpointslices"
CHURNS = {"pods": ("Pod", POD_RESOURCE), "slices": ("EndpointSlice", SLICE_RESOURCE)}
"""Each churn: the kind a watcher counts its events under, the API server's resource label."""


# ---------------------------------------------------------------- processes


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def read_chars(pid: int) -> int:
    """rchar of /proc/PID/io: bytes the process read through read(2) and recv(2) (its
    sockets' TLS streams, a watcher reading nothing else once it runs)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise LookupError(f"no rchar for {pid}")


def reset_peak(pid: int) -> None:
    """Start VmHWM again from the current VmRSS (clear_refs 5, Linux 4.0 and later)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def mib(kib: float) -> float:
    return kib / 1024


# ---------------------------------------------------------------- the API server's metrics


def parse_metrics(text: str, names: Iterable[str]) -> dict[str, float]:
    """The samples of the metric families named, summed per family, suffix and resource
    label (`name_sum{resource=pods}` keys as "name_sum:pods"; unlabelled ones as "name")."""
    wanted = tuple(names)
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(wanted) or not (sample := SAMPLE.match(line)):
            continue
        name, labels, value = sample.groups()
        if name.endswith("_bucket"):
            continue
        tags = dict(LABEL.findall(labels or ""))
        resource = tags.get("resource") or tags.get("kind", "").lower()
        key = f"{name}:{resource}" if resource else name
        found[key] = found.get(key, 0.0) + float(value)
    return found


def scrape(api: ApiClient) -> dict[str, float]:
    method, url, headers, _, _ = api.param_serialize(
        method="GET",
        resource_path="/metrics",
        header_params={"Accept": "text/plain"},
        auth_settings=["BearerToken"],
    )
    response = api.call_api(method, url, header_params=headers)
    return parse_metrics(response.read().decode(), (*WATCH_METRICS, LIVE_HEAP, GOROUTINES))


def watch_bytes(before: dict[str, float], after: dict[str, float], resource: str) -> float:
    """Bytes of watch events the API server encoded for resource between two scrapes."""
    key = f"apiserver_watch_events_sizes_sum:{resource}"
    return after.get(key, 0.0) - before.get(key, 0.0)


# ---------------------------------------------------------------- the cluster


def namespace_name(index: int) -> str:
    return f"watch-{index}"


def node_name(index: int) -> str:
    return f"node-{index:05d}"


def pod_address(index: int) -> str:
    return str(ipaddress.IPv4Address("10.244.0.0") + 2 + index)


def policy_spec(index: int) -> dict[str, Any]:
    return {
        "podSelector": {"matchLabels": {"app": f"a{index % 20}"}},
        "ingress": [
            {
                "from": [{"podSelector": {"matchLabels": {"tier": f"t{index % 5}"}}}],
                "ports": [{"port": 8080}],
            }
        ],
    }


def bulk(calls: list[Callable[[], object]]) -> float:
    began = time.monotonic()
    with ThreadPoolExecutor(WORKERS) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()
    return time.monotonic() - began


def nodes_for(pods: int, per_node: int) -> int:
    return max(1, -(-pods // per_node))


def make_cluster(kube: Kube, options: argparse.Namespace, figures: Figures) -> None:
    kube.install_crd(CRD)
    nodes = nodes_for(options.pods, options.pods_per_node)

    def node(index: int) -> None:
        cidr = f"10.{100 + index // 256}.{index % 256}.0/24"
        address = str(ipaddress.IPv4Address("198.18.0.1") + index)
        kube.call("POST", "/api/v1/nodes", node_object(node_name(index), [address], [cidr]))

    def pod(index: int) -> None:
        namespace = namespace_name(index % options.namespaces)
        labels = {"app": f"a{index % 20}", "tier": f"t{index // options.namespaces % 5}"}
        obj = pod_object(f"pod-{index}", node_name(index % nodes), labels, [("web", 8080, "TCP")])
        kube.create_running_pod(namespace, obj, (pod_address(index),))

    def policy(index: int) -> None:
        path = f"/apis/networking.k8s.io/v1/namespaces/{namespace_name(index)}/networkpolicies"
        kube.call("POST", path, {"metadata": {"name": "policy"}, "spec": policy_spec(index)})

    took = bulk(
        [partial(kube.create_namespace, namespace_name(i)) for i in range(options.namespaces)]
    )
    took += bulk([partial(node, i) for i in range(nodes)])
    took += create_services(kube, range(options.services))
    took += bulk([partial(policy, i) for i in range(options.namespaces)])
    took += bulk([partial(pod, i) for i in range(options.pods)])
    figures.add(
        "the cluster",
        f"{options.pods:,} pods on {nodes:,} nodes in {options.namespaces} namespaces, "
        f"{options.services} services of 10 endpoints, {options.namespaces} NetworkPolicies, "
        f"made in {took:.0f} s",
        key="cluster",
        pods=options.pods,
        nodes=nodes,
        namespaces=options.namespaces,
        services=options.services,
        seconds=round(took, 1),
    )


def held_per_pod(api: kubeapi.Api, pods: int, figures: Figures) -> None:
    """The bytes the policy state holds per pod, and the API server's JSON of one."""
    stop = threading.Event()
    reflector = watch.Reflector(api, watch.pods(), lambda _: None, lambda *_: None, stop)
    whole, _ = reflector.list()
    size = sum(len(json.dumps(item, separators=(",", ":"))) for item in whole) / len(whole)
    del whole
    trimmed = watch.Reflector(
        api, watch.pods(pod_essentials), lambda _: None, lambda *_: None, stop
    )
    items, _ = trimmed.list()
    state = PolicyState("node-00000")
    gc.collect()
    tracemalloc.start()
    state.replace_pods(items)  # the list is emptied: what is left is held
    gc.collect()
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    figures.add(
        "Pod: the API server's JSON, per object",
        f"{size:,.0f} B",
        key="pod_json_bytes",
        bytes=round(size),
    )
    figures.add(
        "Pod: held by the policy state, per object (tracemalloc)",
        f"{held / pods:,.0f} B ({held / pods * 10_000 / 2**20:.1f} MiB per 10,000 pods)",
        key="pod_held_bytes",
        bytes=round(held / pods),
    )


# ---------------------------------------------------------------- watchers


class Watchers:
    """N processes of bench.watch_only of one kind, each watching as node-<i>."""

    def __init__(self, kind: str, count: int, kubeconfig: Path, nodes: int) -> None:
        self.kind = kind
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.watch_only",
                    "--kind",
                    kind,
                    "--kubeconfig",
                    str(kubeconfig),
                    "--node",
                    node_name(index % nodes),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )
            for index in range(count)
        ]
        self.started = [self._line(proc) for proc in self.procs]

    @staticmethod
    def _line(proc: subprocess.Popen[str]) -> dict[str, Any]:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"watcher {proc.pid} exited with {proc.wait()}")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def reports(self) -> list[dict[str, Any]]:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("\n")
            proc.stdin.flush()
        return [self._line(proc) for proc in self.procs]

    def wait(
        self, done: Callable[[list[dict[str, Any]]], bool], timeout: float
    ) -> list[dict[str, Any]]:
        """The watchers' reports once done(reports), or at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            reports = self.reports()
            if done(reports) or time.monotonic() > deadline:
                return reports
            time.sleep(0.2)

    def wait_listed(self, timeout: float) -> list[dict[str, Any]]:
        def listed(reports: list[dict[str, Any]]) -> bool:
            return all(len(r["listed"]) == r["resources"] for r in reports)

        reports = self.wait(listed, timeout)
        if not listed(reports):
            raise TimeoutError(f"{self.kind} watchers not listed in {timeout:.0f} s")
        return reports

    def heard(self, kind: str, before: list[int], reports: list[dict[str, Any]]) -> list[int]:
        """The events of kind each watcher heard since the counts `before`."""
        return [r["events"].get(kind, 0) - b for r, b in zip(reports, before, strict=True)]

    def read_chars(self) -> list[int]:
        return [read_chars(proc.pid) for proc in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------- phases


@dataclass
class Churn:
    changes: int
    seconds: float
    """From the first change to every watcher having heard the last one, and SETTLE after."""
    cpu: float
    """The API server's CPU seconds over those seconds."""
    net_cpu: float
    """The same, less its idle CPU over as long."""
    etcd_cpu: float
    heard: int
    """The fewest of the changes a watcher heard."""
    event_bytes: float
    """Bytes of watch events the API server encoded for the resource (its metric)."""
    received: list[int] = field(default_factory=list)
    """Bytes each watcher read meanwhile (rchar)."""


@dataclass
class Phase:
    kind: str
    watchers: int
    list_seconds: float = 0.0
    list_cpu: float = 0.0
    list_peak_mib: float = 0.0
    """The API server's VmHWM over the first lists."""
    rss_before_mib: float = 0.0
    rss_after_mib: float = 0.0
    live_heap_mib: float = 0.0
    """The API server's live Go heap at the phase's end, its watchers connected."""
    goroutines: int = 0
    idle_seconds: float = 0.0
    idle_cpu: float = 0.0
    churns: dict[str, Churn] = field(default_factory=dict)
    watcher_start_mib: list[float] = field(default_factory=list)
    watcher_listed_mib: list[float] = field(default_factory=list)
    watcher_peak_mib: list[float] = field(default_factory=list)
    watcher_sockets: list[int] = field(default_factory=list)

    @property
    def idle_rate(self) -> float:
        """The API server's CPU seconds per second at idle."""
        return self.idle_cpu / self.idle_seconds if self.idle_seconds else 0.0


class Bench:
    def __init__(self, options: argparse.Namespace, plane: ControlPlane, kube: Kube) -> None:
        self.options = options
        self.kube = kube
        self.api = kube.api
        self.etcd, self.apiserver = (proc.pid for proc in plane.processes[:2])
        self.kubeconfig = plane.kubeconfig
        self.nodes = nodes_for(options.pods, options.pods_per_node)
        self.slices = [SliceChange(kube, service_name(i)) for i in range(options.services)]
        self.changed = 0
        """Changes made so far, which picks the next pod and address."""
        self.phases: list[Phase] = []

    def rss_mib(self) -> float:
        return mib(memory_kib(self.apiserver)["VmRSS"])

    def run(self, kind: str, count: int) -> Phase:
        phase = Phase(kind, count)
        print(f"\n{count} watcher(s) of {kind}'s kind:" if count else "\nno watcher:", flush=True)
        phase.rss_before_mib = self.rss_mib()
        watchers = None
        try:
            if count:
                watchers = self.connect(phase, kind, count)
            time.sleep(SETTLE)
            self.idle(phase)
            phase.rss_after_mib = self.rss_mib()
            for churn in CHURNS:
                self.churn(phase, churn, watchers)
            found = scrape(self.api)
            phase.live_heap_mib = found.get(LIVE_HEAP, 0.0) / 2**20
            phase.goroutines = int(found.get(GOROUTINES, 0))
        finally:
            if watchers is not None:
                watchers.stop()
        self.phases.append(phase)
        return phase

    def connect(self, phase: Phase, kind: str, count: int) -> Watchers:
        reset_peak(self.apiserver)
        cpu, began = cpu_seconds(self.apiserver), time.monotonic()
        watchers = Watchers(kind, count, self.kubeconfig, self.nodes)
        try:
            reports = watchers.wait_listed(300)
        except BaseException:
            watchers.stop()
            raise
        phase.list_seconds = time.monotonic() - began
        phase.list_cpu = cpu_seconds(self.apiserver) - cpu
        phase.list_peak_mib = mib(memory_kib(self.apiserver)["VmHWM"])
        phase.watcher_start_mib = [mib(r["VmRSS"]) for r in watchers.started]
        phase.watcher_listed_mib = [mib(r["VmRSS"]) for r in reports]
        phase.watcher_peak_mib = [mib(r["VmHWM"]) for r in reports]
        phase.watcher_sockets = [r["sockets"] for r in reports]
        print(
            f"  first lists: {phase.list_seconds:.1f} s, API server CPU {phase.list_cpu:.2f} s, "
            f"its peak {phase.list_peak_mib:.0f} MiB; watcher VmRSS "
            f"{statistics.median(phase.watcher_listed_mib):.1f} MiB",
            flush=True,
        )
        return watchers

    def idle(self, phase: Phase) -> None:
        cpu, began = cpu_seconds(self.apiserver), time.monotonic()
        time.sleep(self.options.idle)
        phase.idle_cpu = cpu_seconds(self.apiserver) - cpu
        phase.idle_seconds = time.monotonic() - began
        print(f"  idle: API server CPU {phase.idle_rate * 60:.2f} s per minute", flush=True)

    def change(self, churn: str, index: int) -> None:
        if churn == "pods":
            pod = index * 7919 % self.options.pods
            namespace = namespace_name(pod % self.options.namespaces)
            self.kube.patch(
                f"/api/v1/namespaces/{namespace}/pods/pod-{pod}",
                {"metadata": {"labels": {"churn": f"c{index}"}}},
            )
        else:
            address = str(ipaddress.IPv4Address("10.245.0.0") + index % 60000 + 1)
            self.slices[index % len(self.slices)].apply(address)

    def churn(self, phase: Phase, churn: str, watchers: Watchers | None) -> None:
        changes, rate = self.options.changes, self.options.rate
        kind, resource = CHURNS[churn]
        first = watchers.reports() if watchers else []
        heard_before = [r["events"].get(kind, 0) for r in first]
        received = watchers.read_chars() if watchers else []
        metrics = scrape(self.api)
        cpu, etcd_cpu = cpu_seconds(self.apiserver), cpu_seconds(self.etcd)
        began = time.monotonic()
        for step in range(changes):
            time.sleep(max(0.0, began + step / rate - time.monotonic()))
            self.change(churn, self.changed)
            self.changed += 1
        made = time.monotonic() - began
        heard = 0
        if watchers is not None:
            expected = changes if kind in first[0]["events"] else 0

            def all_heard(reports: list[dict[str, Any]]) -> bool:
                return min(watchers.heard(kind, heard_before, reports)) >= expected

            reports = watchers.wait(all_heard, DELIVERY_TIMEOUT)
            heard = min(watchers.heard(kind, heard_before, reports))
        time.sleep(SETTLE)
        seconds = time.monotonic() - began
        spent = cpu_seconds(self.apiserver) - cpu
        result = Churn(
            changes=changes,
            seconds=seconds,
            cpu=spent,
            net_cpu=spent - phase.idle_rate * seconds,
            etcd_cpu=cpu_seconds(self.etcd) - etcd_cpu,
            heard=heard,
            event_bytes=0.0,
            received=[
                after - before
                for after, before in zip(
                    watchers.read_chars() if watchers else [], received, strict=True
                )
            ],
        )
        result.event_bytes = watch_bytes(metrics, scrape(self.api), resource)
        phase.churns[churn] = result
        print(
            f"  {changes} {churn} changes in {made:.1f} s ({changes / made:.0f}/s), heard by "
            f"every watcher after {seconds - SETTLE:.1f} s (fewest heard {heard}): API server "
            f"CPU {spent:.2f} s ({result.net_cpu:.2f} s over idle), etcd {result.etcd_cpu:.2f} s",
            flush=True,
        )


# ---------------------------------------------------------------- figures


class Figures(list[dict[str, object]]):
    """The run's figures, each printed as it is added."""

    def add(self, figure: str, value: str, **numbers: object) -> None:
        print(f"  {figure}: {value}", flush=True)
        self.append({"figure": figure, "value": value, **numbers})

    def beside(
        self, key: str, figure: str, unit: str, watchers: int, proxy: float, knit: float
    ) -> None:
        """A figure of knit's kind beside kube-proxy's at the same N (0: over every N)."""
        ratio, suffix = ratio_of(knit, proxy), f" {unit}" if unit else ""
        self.add(
            f"{figure}, {watchers} watcher(s)" if watchers else figure,
            f"knit {knit:,.2f}{suffix}, kube-proxy {proxy:,.2f}{suffix} ({ratio})",
            key=key,
            watchers=watchers,
            unit=unit,
            knit=round(knit, 4),
            kube_proxy=round(proxy, 4),
        )


def ratio_of(value: float, anchor: float) -> str:
    if anchor <= 0:
        return "anchor 0"
    return f"{value / anchor:.2f}x"


def slope(points: Iterable[tuple[float, float]]) -> float:
    """The least-squares slope of y over x."""
    pairs = list(points)
    xs, ys = [x for x, _ in pairs], [y for _, y in pairs]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if not spread:
        raise ValueError("a slope needs two values of x")
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread


Measure = tuple[str, str, str, Callable[[Phase], float]]
"""A figure of the API server's: its key, its text per watcher, its unit, and its total in a
phase (per watcher: a phase's less the phase of no watchers', divided by N; or the slope over
every N, that phase's included)."""


def per_change(churn: str, get: Callable[[Churn], float]) -> Callable[[Phase], float]:
    return lambda phase: get(phase.churns[churn]) / phase.churns[churn].changes


def list_peak(phase: Phase) -> float:
    return phase.list_peak_mib - phase.rss_before_mib if phase.watchers else 0.0


MEASURES: list[Measure] = [
    (
        "list_cpu_ms",
        "API server CPU for the first lists",
        "ms",
        lambda phase: phase.list_cpu * 1000,
    ),
    ("list_peak_mib", "API server peak VmRSS over the first lists", "MiB", list_peak),
    (
        "idle_cpu_ms_per_minute",
        "API server idle CPU",
        "ms/min",
        lambda phase: phase.idle_rate * 60_000,
    ),
    ("rss_mib", "API server VmRSS", "MiB", lambda phase: phase.rss_after_mib),
    ("live_heap_mib", "API server live Go heap", "MiB", lambda phase: phase.live_heap_mib),
    ("goroutines", "API server goroutines", "", lambda phase: phase.goroutines),
    *(
        measure
        for churn in CHURNS
        for measure in (
            (
                f"{churn.removesuffix('s')}_change_cpu_us",
                f"API server CPU per {churn.removesuffix('s')} change",
                "µs",
                per_change(churn, lambda found: found.net_cpu * 1e6),
            ),
            (
                f"{churn.removesuffix('s')}_change_event_bytes",
                f"watch event bytes the API server encoded per {churn.removesuffix('s')} change",
                "B",
                per_change(churn, lambda found: found.event_bytes),
            ),
        )
    ),
]


def received_per_change(phase: Phase, churn: str) -> float:
    found = phase.churns[churn]
    return statistics.mean(found.received) / found.changes if found.received else 0.0


WATCHER_MEASURES: list[Measure] = [
    *(
        (
            f"{churn.removesuffix('s')}_change_received_bytes",
            f"bytes a watcher read per {churn.removesuffix('s')} change (TLS)",
            "B",
            lambda phase, churn=churn: received_per_change(phase, churn),
        )
        for churn in CHURNS
    ),
    (
        "watcher_start_mib",
        "watcher VmRSS after start",
        "MiB",
        lambda phase: statistics.median(phase.watcher_start_mib),
    ),
    (
        "watcher_listed_mib",
        "watcher VmRSS after its first lists",
        "MiB",
        lambda phase: statistics.median(phase.watcher_listed_mib),
    ),
    (
        "watcher_peak_mib",
        "watcher peak VmRSS (VmHWM)",
        "MiB",
        lambda phase: statistics.median(phase.watcher_peak_mib),
    ),
    (
        "watcher_sockets",
        "watcher sockets (a connection per watch)",
        "",
        lambda phase: statistics.median(phase.watcher_sockets),
    ),
]
"""The watchers' own figures: the median watcher of a phase."""


def compare(phases: list[Phase], pods: int, figures: Figures) -> None:
    base = next(phase for phase in phases if phase.watchers == 0)
    by = {(phase.kind, phase.watchers): phase for phase in phases if phase.watchers}
    counts = sorted({n for _, n in by})
    print("\nknit's kind beside kube-proxy's kind, per watcher (less the API server's own):")
    for count in counts:
        proxy, knit = by["kube-proxy", count], by["knit", count]
        for key, figure, unit, get in MEASURES:
            figures.beside(
                key,
                f"{figure} per watcher",
                unit,
                count,
                (get(proxy) - get(base)) / count,
                (get(knit) - get(base)) / count,
            )
        for key, figure, unit, get in WATCHER_MEASURES:
            figures.beside(key, figure, unit, count, get(proxy), get(knit))
    if len(counts) > 1:
        print(f"\nper watcher, the slope over N = 0, {', '.join(map(str, counts))}:")
        for key, figure, unit, get in MEASURES:
            fitted = [
                slope([(0, get(base)), *((n, get(by[kind, n])) for n in counts)]) for kind in KINDS
            ]
            figures.beside(f"fit_{key}", f"{figure} per watcher (fit)", unit, 0, *fitted)
    for count in counts:
        proxy, knit = by["kube-proxy", count], by["knit", count]
        added = [
            statistics.median(p.watcher_listed_mib) - statistics.median(p.watcher_start_mib)
            for p in (knit, proxy)
        ]
        per_10k = (added[0] - added[1]) * 10_000 / pods
        figures.add(
            f"watcher memory per 10,000 pods held, {count} watcher(s)",
            f"{per_10k:.1f} MiB (the lists added {added[0]:.1f} MiB to knit's kind, "
            f"{added[1]:.1f} MiB to kube-proxy's)",
            key="watcher_per_10k_pods_mib",
            watchers=count,
            mib=round(per_10k, 2),
        )
    for phase in (base, *by.values()):
        for churn, found in phase.churns.items():
            if phase.watchers and found.heard < (
                found.changes if phase.kind == "knit" or churn == "slices" else 0
            ):
                figures.add(
                    f"WARNING {phase.kind} x{phase.watchers} {churn}",
                    f"a watcher heard only {found.heard} of {found.changes} changes",
                )


def base_figures(base: Phase, figures: Figures) -> None:
    print("\nthe API server with no watcher (every phase's anchor):")
    figures.add(
        "API server idle CPU, no watcher",
        f"{base.idle_rate * 60_000:.0f} ms per minute",
        key="base_idle_cpu_ms_per_minute",
        ms_per_minute=round(base.idle_rate * 60_000, 1),
    )
    figures.add(
        "API server VmRSS, no watcher",
        f"{base.rss_after_mib:.0f} MiB",
        key="base_rss_mib",
        mib=round(base.rss_after_mib),
    )
    figures.add(
        "API server live Go heap, no watcher",
        f"{base.live_heap_mib:.0f} MiB ({base.goroutines:,} goroutines)",
        key="base_live_heap_mib",
        mib=round(base.live_heap_mib),
        goroutines=base.goroutines,
    )
    for churn, found in base.churns.items():
        figures.add(
            f"API server CPU per {churn[:-1]} change, no watcher",
            f"{found.net_cpu / found.changes * 1e6:,.0f} µs (etcd "
            f"{found.etcd_cpu / found.changes * 1e6:,.0f} µs)",
            key=f"base_{churn.removesuffix('s')}_change_cpu_us",
            us=round(found.net_cpu / found.changes * 1e6),
            etcd_us=round(found.etcd_cpu / found.changes * 1e6),
        )
        figures.add(
            f"watch event bytes per {churn[:-1]} change, no watcher (the API server's own)",
            f"{found.event_bytes / found.changes:,.0f} B",
            key=f"base_{churn.removesuffix('s')}_change_event_bytes",
            bytes=round(found.event_bytes / found.changes),
        )


def variant(options: argparse.Namespace) -> str:
    """The part of the result file's name saying how the run differs from the default one."""
    parts = []
    if options.pods != 10_000:
        parts.append(f"pods-{options.pods}")
    if options.watchers != "1,10,50":
        parts.append("watchers-" + options.watchers.replace(",", "-"))
    if options.changes != 1000:
        parts.append(f"changes-{options.changes}")
    if options.rate != 50:
        parts.append(f"rate-{options.rate:g}")
    return "-".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=10_000)
    parser.add_argument("--watchers", default="1,10,50", help="numbers of watchers, e.g. 1,10")
    parser.add_argument("--changes", type=int, default=1000, help="pod (and slice) changes")
    parser.add_argument("--rate", type=float, default=50.0, help="changes a second")
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of idle measured")
    parser.add_argument("--namespaces", type=int, default=100)
    parser.add_argument("--pods-per-node", type=int, default=30)
    parser.add_argument("--services", type=int, default=100)
    record.add_json_option(parser)
    options = parser.parse_args()
    counts = sorted(int(n) for n in options.watchers.split(","))
    exit_on_termination()
    began_at = record.revision()
    print(f"at {began_at}", flush=True)
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="knit-watch-cost-") as tmp, ExitStack() as stack:
        plane, _, kube = bench_api(stack, Path(tmp))
        make_cluster(kube, options, figures)
        held_per_pod(kubeapi.from_kubeconfig([plane.kubeconfig]), options.pods, figures)
        bench = Bench(options, plane, kube)
        base = bench.run("none", 0)
        for count in counts:
            for kind in KINDS:
                bench.run(kind, count)
    base_figures(base, figures)
    compare(bench.phases, options.pods, figures)
    print(f"command: {' '.join(sys.orig_argv)} (at {began_at})")
    path = record.result_path(options.json, "api-watch-cost", variant(options))
    record.write(path, figures, began_at, phases=[asdict(phase) for phase in bench.phases])


if __name__ == "__main__":
    main()
