"""Where knit-proxyd's fixed cost goes: what a small cluster's daemon pays whatever it holds.

- the interpreter: `python -c pass` (wall, from this process) and its resident memory;
- the libraries, in the daemon's import order, each timed and its resident memory (VmRSS)
  read in a fresh interpreter that imports one after the other (its API client with ssl,
  http.client and yaml, prometheus_client, then the rest of knit's own modules,
  proxyd.daemon), and its API client alone; beside them, each alone, what the daemon imported
  before: the kubernetes client, and pyroute2 (now the IPVS mode's alone);
- the watch caches: the Services and EndpointSlices of N services (one port, 10 endpoints
  each, as in the proxy bench) listed from a real API server by the daemon's reflector, then
  held by its cluster state: the bytes tracemalloc sees per Service and slice, beside the
  size of the API server's JSON of them;
- the start: knit-proxyd (--mode, nftables by default) started --rounds times in fresh node
  namespaces against those objects, as the proxy bench starts it: from its launch to its
  "running" line (the interpreter, the imports, its set-up), to its first full sync done
  (the cold start), the first full sync itself (its metric), and its VmRSS then.

Times are medians of --rounds runs, with the lowest and highest; the machine's other work
moves them, memory hardly at all.

Run as root from the repository root (~1 minute):
  .venv/bin/python -m bench.proxy_fixed_cost [--services 100] [--rounds 5] [--mode nftables]
"""

from __future__ import annotations

import argparse
import gc
import json
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path

from bench import record
from bench.proxy_cluster import NODE, NODE_ADDRESS, bench_api, create_services, start_knit
from bench.proxy_daemon import FULL, LAST_SYNC
from bench.proxy_modes import Iptables, Mode, Nftables
from bench.proxy_netns import make_netns
from deploy.lab.controlplane import ControlPlane
from deploy.lab.kube import node_object
from deploy.lab.paths import ROOT
from deploy.lab.process import exit_on_termination
from deploy.lab.relay import NetnsForward
from proxyd import kubeapi, watch
from proxyd.tracker import ClusterState

IMPORTS = """
import importlib, json, sys, time
def rss():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024
steps = [("", 0.0, rss())]
for name in sys.argv[1:]:
    began = time.perf_counter()
    importlib.import_module(name)
    steps.append((name, time.perf_counter() - began, rss()))
print(json.dumps(steps))
"""
"""Imports the modules named, one after the other: each one's seconds and the VmRSS after it
(the first step: the interpreter's own)."""
CHAINS = (
    ("in the daemon's order", ("proxyd.kubeapi", "prometheus_client", "proxyd.daemon")),
    ("alone", ("proxyd.kubeapi",)),
    ("what it no longer imports, alone", ("kubernetes",)),
    ("what it no longer imports, alone", ("pyroute2",)),
)
"""Modules imported one after the other in one interpreter, each chain in a fresh one."""
RUNNING = "running on node"
"""The daemon's line once its watches and node networking are started (Daemon.run)."""
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


class Figures(list[dict[str, object]]):
    """The run's figures, each printed as it is measured."""

    def add(self, figure: str, value: str, **numbers: float) -> None:
        print(f"  {figure}: {value}", flush=True)
        self.append({"figure": figure, "value": value, **numbers})

    def spread(self, figure: str, samples: list[float], unit: str, scale: float = 1.0) -> None:
        low, mid, high = (
            scale * value for value in (min(samples), statistics.median(samples), max(samples))
        )
        self.add(
            figure,
            f"{mid:.0f} {unit} ({low:.0f}-{high:.0f})",
            median=round(mid, 1),
            low=round(low, 1),
            high=round(high, 1),
        )


def import_steps(modules: tuple[str, ...], rounds: int) -> list[tuple[str, list[float], float]]:
    """Per module: its import's seconds in each round, and the VmRSS (MiB) it added."""
    runs = []
    for _ in range(rounds):
        found = subprocess.run(
            [sys.executable, "-c", IMPORTS, *modules],
            capture_output=True,
            text=True,
            check=True,
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
        )
        runs.append(json.loads(found.stdout))
    steps = []
    for index, name in enumerate(("", *modules)):
        seconds = [run[index][1] for run in runs]
        added = statistics.median(
            run[index][2] - (run[index - 1][2] if index else 0.0) for run in runs
        )
        steps.append((name, seconds, added))
    return steps


def imports(rounds: int, figures: Figures) -> None:
    print("the interpreter and the libraries, each import in a fresh interpreter:")
    walls = []
    for _ in range(rounds):
        began = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        walls.append(time.perf_counter() - began)
    figures.spread("interpreter: `python -c pass` (wall)", walls, "ms", 1000)
    for index, (how, chain) in enumerate(CHAINS):
        for name, seconds, added in import_steps(chain, rounds):
            if not name:
                if index == 0:
                    figures.add(
                        "interpreter: VmRSS at start", f"{added:.1f} MiB", mib=round(added, 1)
                    )
                continue
            figures.spread(f"import {name} ({how}): time", seconds, "ms", 1000)
            figures.add(
                f"import {name} ({how}): VmRSS added", f"{added:.1f} MiB", mib=round(added, 1)
            )


def watch_caches(api: kubeapi.Api, services: int, figures: Figures) -> None:
    """The cluster state's memory per Service and per slice, as the daemon holds them."""
    print(f"the watch caches at {services} services:")
    state, stop = ClusterState(NODE), threading.Event()
    lists = {
        resource.kind: watch.Reflector(api, resource, replace, event, stop).list()[0]
        for resource, replace, event in (
            (watch.services(), state.replace_services, state.service_event),
            (watch.endpoint_slices(), state.replace_slices, state.slice_event),
        )
    }
    counts = {kind: len(items) for kind, items in lists.items()}
    for kind, items in lists.items():
        size = sum(len(json.dumps(item)) for item in items) / len(items)
        figures.add(
            f"{kind}: the API server's JSON, per object", f"{size:.0f} B", bytes=round(size)
        )
    gc.collect()
    tracemalloc.start()
    state.replace_services(lists["Service"])
    services_held, _ = tracemalloc.get_traced_memory()  # the list is emptied: what is left is held
    state.replace_slices(lists["EndpointSlice"])
    gc.collect()
    both, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    figures.add(
        "Service: held by the cluster state, per object",
        f"{services_held / counts['Service']:.0f} B",
        bytes=round(services_held / counts["Service"]),
    )
    per_slice = (both - services_held) / counts["EndpointSlice"]
    figures.add(
        "EndpointSlice: held by the cluster state, per object",
        f"{per_slice:.0f} B",
        bytes=round(per_slice),
    )


def log_offset(log: Path, text: str, started: float) -> float:
    """Seconds from the launch to the first log line holding text."""
    for line in log.read_text(errors="replace").splitlines():
        if text in line and (stamp := LOG_TIME.match(line)):
            return datetime.strptime(stamp[1], "%Y-%m-%d %H:%M:%S,%f").timestamp() - started
    raise LookupError(f"no line of {log} holds {text!r}")


def starts(
    plane: ControlPlane, mode: Mode, services: int, rounds: int, work: Path, figures: Figures
) -> None:
    print(f"knit-proxyd's start at {services} services, {mode.name} mode, {rounds} times:")
    running, cold, first, rss = [], [], [], []
    for round_ in range(rounds):
        with ExitStack() as stack:
            node = make_netns("node", stack)
            mode.prepare(node)
            forward = NetnsForward(node.name, plane.port)
            stack.callback(forward.stop)
            kubeconfig = plane.write_kubeconfig(work / f"kubeconfig-{round_}", forward.listen_port)
            folder = work / f"start-{round_}"
            daemon = start_knit(node, kubeconfig, folder, mode.name, folder / "proxyd.log", None)
            stack.callback(daemon.stop)
            synced = daemon.wait_sync(FULL, 0, 120)
            rss.append(daemon.memory_mib()[0])
            cold.append(synced[LAST_SYNC] - daemon.started)
            first.append(daemon.spent(synced, {}, FULL))
            running.append(log_offset(daemon.log, RUNNING, daemon.started))
    figures.spread("launch to its running line (interpreter, imports, set-up)", running, "ms", 1000)
    figures.spread("cold start: launch to the first full sync done", cold, "ms", 1000)
    figures.spread("first full sync (metric)", first, "ms", 1000)
    figures.spread("VmRSS after start", rss, "MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mode", choices=("iptables", "nftables"), default="nftables")
    record.add_json_option(parser)
    options = parser.parse_args()
    exit_on_termination()
    began_at = record.revision()
    figures = Figures()
    imports(options.rounds, figures)
    mode: Mode = Nftables() if options.mode == "nftables" else Iptables("nft")
    with tempfile.TemporaryDirectory(prefix="knit-fixed-cost-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        plane, _, kube = bench_api(stack, work)
        kube.call("POST", "/api/v1/nodes", node_object(NODE, [NODE_ADDRESS], zone="zone-a"))
        create_services(kube, range(options.services))
        watch_caches(kubeapi.from_kubeconfig([plane.kubeconfig]), options.services, figures)
        starts(plane, mode, options.services, options.rounds, work, figures)
    variant = f"{options.mode}-{options.services}"
    record.write(record.result_path(options.json, "proxy-fixed-cost", variant), figures, began_at)


if __name__ == "__main__":
    main()
