"""The cost of a large cluster's watches, on paper: what the API server and each daemon pay for
knit-proxyd's watches beside kube-proxy's, at a number of nodes, from the per-watcher figures
bench.api_watch_cost measured and the assumptions below (docs/scale.md explains both).

Every rate is per second, cluster-wide unless it says per node. The model is linear: each
watcher receives every event of what it watches, and the API server pays each event once per
watcher (its encoding is shared; the measured per-watcher cost is what a watcher adds).

  .venv/bin/python -m bench.scale_model docs/results/DATE-api-watch-cost.json [--nodes 1000,5000]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("knit", "kube_proxy")


@dataclass(frozen=True)
class Assumptions:
    pods_per_node: int = 30
    pod_starts_per_1000_nodes: float = 30.0
    """Pods started (and as many deleted) per second per 1,000 nodes: the churn of Cilium's
    1,000-node GKE test (cilium/cilium#15153); a pod lives 1,000 s on average at 30 a node."""
    pod_events_per_life: float = 8.0
    """Watch events a pod's life makes for a watcher of all pods: created, bound, three status
    writes by kubelet (pending, running with its IP, ready), marked for deletion, its final
    status, deleted."""
    slice_events_per_life: float = 3.0
    """EndpointSlice events a pod's life makes, every pod behind a Service: ready, terminating,
    removed (the slice controller batching none of them)."""
    node_status_seconds: float = 300.0
    """How often a Node object changes: kubelet's status report when nothing else changed
    (nodeStatusReportFrequency, 5 minutes); leases, every 10 s, are objects of their own."""
    node_event_bytes: float = 10_000.0
    """A real Node's JSON: its status lists up to 50 images (kubelet's nodeStatusMaxImages)."""


@dataclass(frozen=True)
class Watcher:
    """What one watcher of a kind costs, measured by bench.api_watch_cost."""

    pod_event_bytes: float
    """The bytes of one pod event on the wire (TLS) to this watcher."""
    slice_event_bytes: float
    rss_mib: float
    """The API server's VmRSS per watcher connected."""
    goroutines: float
    """The API server's goroutines per watcher connected."""
    list_ms: float
    """The API server's CPU for this watcher's first lists, at the bench's cluster."""
    listed_mib: float
    """The watcher's VmRSS after its first lists."""


@dataclass(frozen=True)
class Measured:
    pods: int
    """The pods of the bench's cluster."""
    pod_json_bytes: float
    event_us: float
    """The API server's CPU per event it sends one watcher: the mean of the fits where a
    watcher receives the changes (pods to knit's kind, slices to both kinds)."""
    mib_per_10k_pods: float
    """A knit watcher's memory per 10,000 pods held."""
    knit: Watcher
    kube_proxy: Watcher


@dataclass(frozen=True)
class Cost:
    """One kind of daemon on every node of a cluster."""

    events_per_node: float
    """Watch events each daemon receives per second."""
    egress_mb: float
    """The API server's egress to all the daemons, MB per second."""
    cpu_cores: float
    """The API server's CPU for sending them, cores."""
    watch_rss_gib: float
    """The API server's memory for the daemons' watches, GiB."""
    goroutines: float
    """The API server's goroutines for the daemons' watches."""
    relist_core_seconds: float
    """The API server's CPU for every daemon's first lists at once (an API server restart)."""
    daemon_mib: float
    """Each daemon's watch caches: a watcher process's VmRSS after its first lists."""


def event_rates(nodes: int, assumptions: Assumptions) -> dict[str, float]:
    """Cluster-wide events per second of pods, slices and nodes."""
    starts = assumptions.pod_starts_per_1000_nodes * nodes / 1000
    return {
        "pod": starts * assumptions.pod_events_per_life,
        "slice": starts * assumptions.slice_events_per_life,
        "node": nodes / assumptions.node_status_seconds,
    }


def cost(kind: str, nodes: int, measured: Measured, assumptions: Assumptions) -> Cost:
    """What `kind`'s watches cost at `nodes` nodes."""
    watcher = measured.knit if kind == "knit" else measured.kube_proxy
    rates = event_rates(nodes, assumptions)
    pods = nodes * assumptions.pods_per_node
    # a Node event costs the API server what a pod event costs, per byte
    node_us = measured.event_us * assumptions.node_event_bytes / measured.pod_json_bytes
    # per kind of object: the events each daemon receives a second, the API server's CPU (µs)
    # and the bytes of each
    received = {"slice": (rates["slice"], measured.event_us, watcher.slice_event_bytes)}
    if kind == "knit":
        received["pod"] = (rates["pod"], measured.event_us, watcher.pod_event_bytes)
        received["node"] = (rates["node"], node_us, assumptions.node_event_bytes)
        relist_ms = watcher.list_ms * pods / measured.pods
        daemon = watcher.listed_mib + (pods - measured.pods) / 10_000 * measured.mib_per_10k_pods
    else:  # its own Node's status reports only
        own = 1 / assumptions.node_status_seconds
        received["node"] = (own, node_us, assumptions.node_event_bytes)
        relist_ms = watcher.list_ms
        daemon = watcher.listed_mib
    return Cost(
        events_per_node=sum(rate for rate, _, _ in received.values()),
        egress_mb=nodes * sum(rate * size for rate, _, size in received.values()) / 1e6,
        cpu_cores=nodes * sum(rate * us for rate, us, _ in received.values()) / 1e6,
        watch_rss_gib=nodes * watcher.rss_mib / 1024,
        goroutines=nodes * watcher.goroutines,
        relist_core_seconds=nodes * relist_ms / 1000,
        daemon_mib=daemon,
    )


def figure(figures: list[dict[str, Any]], key: str, watchers: int | None = None) -> dict[str, Any]:
    """The result file's figure of key (at `watchers`; the last one when None)."""
    found = [f for f in figures if f.get("key") == key]
    if watchers is not None:
        found = [f for f in found if f.get("watchers") == watchers]
    if not found:
        raise LookupError(f"no figure {key!r} in the results")
    return found[-1]


def measured_from(results: dict[str, Any]) -> Measured:
    """The model's inputs from a result file of bench.api_watch_cost: the fits over every N for
    the API server's figures, the largest N's for the watchers' own."""
    figures = results["figures"]
    largest = max(f["watchers"] for f in figures if f.get("key") == "watcher_listed_mib")

    def fit(key: str, kind: str) -> float:
        return float(figure(figures, f"fit_{key}")[kind])

    def watcher(kind: str) -> Watcher:
        def at_largest(key: str) -> float:
            return float(figure(figures, key, largest)[kind])

        return Watcher(
            pod_event_bytes=at_largest("pod_change_received_bytes"),
            slice_event_bytes=at_largest("slice_change_received_bytes"),
            rss_mib=fit("rss_mib", kind),
            goroutines=fit("goroutines", kind),
            list_ms=fit("list_cpu_ms", kind),
            listed_mib=at_largest("watcher_listed_mib"),
        )

    received = (
        fit("pod_change_cpu_us", "knit"),
        fit("slice_change_cpu_us", "knit"),
        fit("slice_change_cpu_us", "kube_proxy"),
    )
    return Measured(
        pods=int(figure(figures, "cluster")["pods"]),
        pod_json_bytes=float(figure(figures, "pod_json_bytes")["bytes"]),
        event_us=sum(received) / len(received),
        mib_per_10k_pods=float(figure(figures, "watcher_per_10k_pods_mib", largest)["mib"]),
        knit=watcher("knit"),
        kube_proxy=watcher("kube_proxy"),
    )


ROWS = (
    ("watch events each daemon receives", "/s", "events_per_node", "{:,.0f}"),
    ("API server egress to the daemons", "MB/s", "egress_mb", "{:,.1f}"),
    ("API server CPU to send them", "cores", "cpu_cores", "{:,.2f}"),
    ("API server VmRSS for the watches", "GiB", "watch_rss_gib", "{:,.1f}"),
    ("API server goroutines for the watches", "", "goroutines", "{:,.0f}"),
    ("API server CPU for every daemon's relist", "core-s", "relist_core_seconds", "{:,.0f}"),
    ("each daemon's watch caches (VmRSS)", "MiB", "daemon_mib", "{:,.0f}"),
)


def table(measured: Measured, assumptions: Assumptions, sizes: list[int]) -> str:
    """A Markdown table: each row's figure for knit and kube-proxy at each size, and the
    ratio."""
    head = [
        "figure",
        *(f"{n:,} nodes: {k}" for n in sizes for k in ("knit", "kube-proxy", "ratio")),
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    costs = {(kind, n): cost(kind, n, measured, assumptions) for kind in KINDS for n in sizes}
    for text, unit, attribute, form in ROWS:
        cells = [f"{text} ({unit})" if unit else text]
        for n in sizes:
            knit = getattr(costs["knit", n], attribute)
            proxy = getattr(costs["kube_proxy", n], attribute)
            ratio = f"{knit / proxy:,.0f}x" if proxy else "-"
            cells += [form.format(knit), form.format(proxy), ratio]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a result file of bench.api_watch_cost")
    parser.add_argument("--nodes", default="1000,5000")
    parser.add_argument("--churn", type=float, default=Assumptions.pod_starts_per_1000_nodes)
    options = parser.parse_args()
    measured = measured_from(json.loads(options.results.read_text()))
    assumptions = Assumptions(pod_starts_per_1000_nodes=options.churn)
    print(f"measured: {measured}\nassumed: {assumptions}\n")
    print(table(measured, assumptions, [int(n) for n in options.nodes.split(",")]))


if __name__ == "__main__":
    main()
