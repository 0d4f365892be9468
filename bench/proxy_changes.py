"""One-service changes: one endpoint of one service's EndpointSlice replaced in the API, and
the same change as the mode's bare partial load; knit-proxyd's figures of them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

from bench.proxy_cluster import NODE, PORT, REMOTE_NODE, TARGET_PORT, SliceChange, service_name
from bench.proxy_daemon import KNIT, LAST_SYNC, PARTIAL, Daemon, programming
from bench.proxy_modes import Mode, timed
from bench.proxy_netns import in_netns
from bench.proxy_report import PARTIAL_SYNC, PROGRAMMED, Results, ms, ratio
from deploy.lab.kube import SERVICES, Kube
from deploy.lab.netns import Netns
from deploy.lab.process import eventually
from proxyd.config import load as load_config
from proxyd.daemon import make_proxier
from proxyd.metrics import Metrics
from proxyd.model import Endpoint, ServicePort, ServicePortName, parse_node
from proxyd.port_plan import PortPlan, plan_port

OUTSIDE_POLL_LIMIT = 0.05
"""Seconds one look at the kernel may cost to be polled during a change (legacy: ~0.8 s at
10,000 services, holding the xtables lock the daemon's restore waits for)."""
CHANGE_GOAL = 0.02
"""nftables: seconds a one-service change may take."""
SIZE_GROWTH_GOAL = 1.5
"""nftables: a partial sync at the largest N costs at most this many at the smallest."""
PROGRAMMING_METRIC = "network programming metric"


class OneServiceChange:
    """Replaces one endpoint of one service's slice at a time: in the API, and (rendered by the
    daemon's code, in the context the daemon's proxier builds for the node) as the mode's
    partial load of the same change."""

    def __init__(
        self, kube: Kube, mode: Mode, daemon: Daemon, index: int, fresh: Iterator[str]
    ) -> None:
        self.mode = mode
        self.fresh = fresh
        self.slice = SliceChange(kube, service_name(index))
        self.name = self.slice.name
        spec = kube.call("GET", f"{SERVICES}/{self.name}")["spec"]
        self.cluster_ip = spec["clusterIP"]
        port_name = ServicePortName("default", self.name, "", "TCP")
        self.port = ServicePort(port_name, (self.cluster_ip,), PORT)
        node = parse_node(kube.call("GET", f"/api/v1/nodes/{NODE}"))
        settings = load_config(daemon.args)
        self.ctx = in_netns(  # the iptables proxier detects the flavour where it is made
            daemon.ns, lambda: make_proxier(mode.name, settings, Metrics()).context(4, node)
        )

    def _plan(self, endpoints: list[dict[str, Any]]) -> PortPlan:
        ordered = sorted(
            (Endpoint(e["addresses"][0], TARGET_PORT, node_name=REMOTE_NODE) for e in endpoints),
            key=lambda e: e.ip,
        )
        plan = plan_port(self.port, tuple(ordered), self.ctx)
        assert plan is not None
        return plan

    def listed(self, ns: Netns) -> str:
        """The service's endpoints as ns's kernel holds them."""
        return self.mode.endpoints(ns, self.name, self.cluster_ip)

    def apply(self) -> tuple[str, str]:
        """Patch the slice; return (the new endpoint's address, the change)."""
        before = self._plan(self.slice.endpoints)
        new_ip = next(self.fresh)
        self.slice.apply(new_ip)
        return new_ip, self.mode.change(self.ctx, before, self._plan(self.slice.endpoints))


class OneServiceChanges:
    """knit-proxyd's one-service changes, measured at each N, and their growth with N."""

    def __init__(self, kube: Kube, results: Results, fresh: Iterator[str], quick: bool) -> None:
        self.kube = kube
        self.results = results
        self.fresh = fresh
        """Addresses no endpoint had."""
        self.quick = quick
        self.partial: dict[str, dict[int, tuple[float, float]]] = {}
        """mode -> N -> (median partial sync, median bare load) of one-service changes."""

    def measure(self, size: int, mode: Mode, daemon: Daemon, anchor: Netns) -> None:
        """Changes measured by metrics and the daemon's timestamp; then, when a look at the
        kernel is cheap, as many changes polled from outside (not mixed: polling costs)."""
        node = daemon.ns
        change = OneServiceChange(self.kube, mode, daemon, size // 2, self.fresh)

        def programmed(target: str) -> bool:
            return target in change.listed(node)

        def one(polled: bool) -> None:
            """One change, its figures added to latencies, or (not polled) syncs and bares."""
            time.sleep(1.0)  # the daemon's default --min-sync-period, since the last sync
            before, since = daemon.metrics(), daemon.log_size()
            target, script = change.apply()
            patched, patched_at = time.monotonic(), time.time()
            if polled:
                eventually(
                    lambda: programmed(target),
                    60,
                    f"{target} among {change.name}'s endpoints",
                    interval=0.005,
                )
                latencies["polled from outside"].append(time.monotonic() - patched)
            after = daemon.wait_sync(PARTIAL, since, 60, change=before)
            assert programmed(target), f"{target} was not programmed"
            bare = mode.load(anchor, [(4, script)])
            assert change.listed(anchor) == change.listed(node), (
                f"the bare change left {change.name}'s endpoints unlike the daemon's"
            )
            if not polled:
                latencies["daemon's timestamp"].append(after[LAST_SYNC] - patched_at)
                latencies[PROGRAMMING_METRIC].append(programming(after, before))
                syncs.append(daemon.spent(after, before, PARTIAL))
                bares.append(bare)

        poll_cost = timed(lambda: programmed(""))
        outside = poll_cost < OUTSIDE_POLL_LIMIT
        syncs: list[float] = []
        bares: list[float] = []
        latencies: dict[str, list[float]] = {
            "daemon's timestamp": [],
            PROGRAMMING_METRIC: [],
            "polled from outside": [],
        }
        changes = 5 if self.quick else 10
        for polled in [False] * changes + [True] * (changes if outside else 0):
            one(polled)
        self.partial.setdefault(mode.name, {})[size] = (
            statistics.median(syncs),
            statistics.median(bares),
        )
        goal = f"< {ms(CHANGE_GOAL)}"
        for label, values in (("median", statistics.median), ("max", max)):
            sync, bare = values(syncs), values(bares)
            self.results.add(
                mode,
                size,
                f"one-service change: partial sync ({label}, metric)",
                ms(sync),
                f"bare {mode.loader} of the change ({label}) {ms(bare)}",
                ratio(sync, bare),
                (goal, sync < CHANGE_GOAL) if label == "median" else None,
            )
        for how, samples in latencies.items():
            for label, values in (("median", statistics.median), ("max", max)):
                if samples:
                    latency = values(samples)
                    self.results.add(
                        mode,
                        size,
                        f"one-service change: PATCH to rules in kernel ({label}, {how})",
                        ms(latency),
                        goal=(goal, latency < CHANGE_GOAL) if label == "median" else None,
                    )
        self.results.keep(mode, size, PARTIAL_SYNC, KNIT, statistics.median(syncs))
        self.results.keep(
            mode, size, PROGRAMMED, KNIT, statistics.median(latencies[PROGRAMMING_METRIC])
        )
        look = f"one look at {change.name}'s endpoints costs {ms(poll_cost)}"
        print(f"  ({look}{'' if outside else ', too much to poll without disturbing the daemon'})")

    def size_growth(self, sizes: list[int], modes: list[Mode]) -> None:
        """The partial sync at the largest N against the smallest's, for each mode, beside the
        bare load's growth."""
        smallest, largest = sizes[0], sizes[-1]
        for mode in modes:
            medians = self.partial.get(mode.name, {})
            if smallest != largest and smallest in medians and largest in medians:
                (sync_small, bare_small), (sync_large, bare_large) = (
                    medians[smallest],
                    medians[largest],
                )
                growth = sync_large / sync_small
                self.results.add(
                    mode,
                    largest,
                    f"one-service change: growth of the median from N={smallest}",
                    f"{ratio(sync_large, sync_small)} ({ms(sync_small)} to {ms(sync_large)})",
                    f"bare {mode.loader} {ratio(bare_large, bare_small)} "
                    f"({ms(bare_small)} to {ms(bare_large)})",
                    goal=(f"<= {SIZE_GROWTH_GOAL}x", growth <= SIZE_GROWTH_GOAL),
                )
