"""Soak: an hour of churn at a steady rate on a fresh lab (deploy/lab/churn.py, no faults),
knit-proxyd's memory, threads, file descriptors and sync times sampled on every node.

The goal: flat. Each figure's level over minutes 5 to 10 (past the start's warm-up) is the
anchor of its level over the last five minutes; growth under 5% is met. The samples go into
the dated result file beside the figures, and a chart of memory and sync times over the run
beside it (docs/results/DATE-soak.json, .png).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from bench import record
from deploy.lab import churn
from deploy.lab.faults import footprint
from deploy.lab.lab import PROXY_MODES, Lab
from deploy.lab.netns import unique_name
from deploy.lab.paths import ROOT

METRICS = "http://127.0.0.1:10249/metrics"
# (what the chart and figures call it, the histogram knit-proxyd exports)
SYNCS = (
    ("proxy sync", "kubeproxy_sync_proxy_rules_duration_seconds"),
    ("policy sync", "knit_network_policy_sync_duration_seconds"),
)
GOAL = 0.05
BASELINE = (5.0, 10.0)  # minutes
FINAL = 5.0  # the last minutes


@dataclass(frozen=True)
class Sample:
    minute: float
    node: str
    rss_kib: int
    threads: int
    fds: int
    syncs: dict[str, tuple[float, float]]
    """Each histogram's (sum of seconds, count) so far."""


def histogram_totals(text: str, name: str) -> tuple[float, float]:
    """A histogram's sum and count over every label set (both families) in a metrics page."""
    total = count = 0.0
    for line in text.splitlines():
        metric, _, value = line.rpartition(" ")
        if metric.startswith(f"{name}_sum"):
            total += float(value)
        elif metric.startswith(f"{name}_count"):
            count += float(value)
    return total, count


def sample(lab: Lab, node: str, minute: float) -> Sample:
    process = footprint(lab, node)
    page = lab.nodes[node].machine.run("curl", "-sf", METRICS)
    syncs = {label: histogram_totals(page, metric) for label, metric in SYNCS}
    return Sample(minute, node, process.rss_kib, process.threads, process.fds, syncs)


def mean_syncs(samples: list[Sample], label: str) -> list[tuple[float, float]]:
    """(minute, mean sync milliseconds since the sample before) where syncs happened; a
    counter that went back (a restarted daemon) starts over."""
    means = []
    for before, after in itertools.pairwise(samples):
        seconds = after.syncs[label][0] - before.syncs[label][0]
        count = after.syncs[label][1] - before.syncs[label][1]
        if count > 0:
            means.append((after.minute, 1000 * seconds / count))
    return means


def _median(points: list[tuple[float, float]], first: float, last: float) -> float | None:
    inside = [value for minute, value in points if first <= minute < last]
    return statistics.median(inside) if inside else None


def _sync_mean(samples: list[Sample], label: str, first: float, last: float) -> float | None:
    """The mean sync time (ms) over a window: its syncs' time over their number, from its
    first sample to its last. A median of the samples' means would weigh a sample of one slow
    sync like one of thirty."""
    inside = [s for s in samples if first <= s.minute < last]
    if len(inside) < 2:
        return None
    seconds = inside[-1].syncs[label][0] - inside[0].syncs[label][0]
    count = inside[-1].syncs[label][1] - inside[0].syncs[label][1]
    return 1000 * seconds / count if count > 0 else None


def figures(samples: list[Sample]) -> list[dict[str, Any]]:
    """Each node's figures, over minutes 5-10 and the last five minutes sampled."""
    end = max(s.minute for s in samples)
    windows = (BASELINE, (end - FINAL, end + 1))
    rows = []
    for node in sorted({s.node for s in samples}):
        mine = [s for s in samples if s.node == node]
        levels: dict[str, tuple[list[float | None], str]] = {
            name: ([_median(points, *window) for window in windows], unit)
            for name, points, unit in (
                ("memory (RSS)", [(s.minute, s.rss_kib / 1024) for s in mine], "MiB"),
                ("threads", [(s.minute, float(s.threads)) for s in mine], ""),
                ("open file descriptors", [(s.minute, float(s.fds)) for s in mine], ""),
            )
        }
        for label, _ in SYNCS:
            means = [_sync_mean(mine, label, *window) for window in windows]
            levels[f"{label} time, mean"] = (means, "ms")
        for name, ([baseline, final], unit) in levels.items():
            if baseline is None or final is None:
                rows.append({"step": node, "figure": name, "knit": "not sampled", "goal": ""})
                continue
            growth = final / baseline - 1 if baseline else 0.0
            rows.append(
                {
                    "step": node,
                    "figure": f"{name}: minutes {BASELINE[0]:g}-{BASELINE[1]:g} -> last {FINAL:g}",
                    "knit": f"{baseline:.1f} -> {final:.1f} {unit}".strip(),
                    "anchor": "its own level over minutes 5-10",
                    "ratio": f"{final / baseline:.3f}x" if baseline else "",
                    "goal": f"growth < {GOAL:.0%}: {'met' if growth < GOAL else 'NOT met'}",
                }
            )
    return rows


def draw(samples: list[Sample], out: Path, title: str) -> None:
    figure, (memory, syncs) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    for node in sorted({s.node for s in samples}):
        mine = [s for s in samples if s.node == node]
        memory.plot([s.minute for s in mine], [s.rss_kib / 1024 for s in mine], label=node)
        for label, _ in SYNCS:
            points = mean_syncs(mine, label)
            syncs.plot([m for m, _ in points], [v for _, v in points], label=f"{node} {label}")
    memory.set_ylabel("knit-proxyd RSS (MiB)")
    memory.set_ylim(bottom=0)
    memory.legend(fontsize=8)
    syncs.set_ylabel("mean sync time per sample (ms)")
    syncs.set_xlabel("minutes of churn")
    syncs.set_ylim(bottom=0)
    syncs.legend(fontsize=7, ncol=2)
    memory.set_title(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    print(f"chart drawn in {out}")


def soak(lab: Lab, folder: Path, minutes: float, every: float, max_replicas: int) -> list[Sample]:
    churn.setup(lab, folder)
    changes = churn.Churn(lab, folder, random.Random(), max_replicas)
    samples: list[Sample] = []
    start = time.monotonic()
    changes.start()
    try:
        while (elapsed := (time.monotonic() - start) / 60) < minutes:
            samples += [sample(lab, node, elapsed) for node in lab.nodes]
            time.sleep(every)
    finally:
        changes.stop()
    print(f"churn: {changes.made} changes, {changes.refused} refused")
    return samples


def report(samples: list[Sample], path: Path, title: str) -> None:
    """The figures printed and the chart drawn beside the result file."""
    for row in figures(samples):
        print(f"{row['step']}: {row['figure']}: {row['knit']} {row.get('ratio', '')} {row['goal']}")
    draw(samples, path.with_suffix(".png"), title)


def redraw(path: Path) -> None:
    """A result file's figures and chart made again from its samples (the figures' reading
    changed, not the run)."""
    result = json.loads(path.read_text())
    samples = [
        Sample(**{**s, "syncs": {k: tuple(v) for k, v in s["syncs"].items()}})
        for s in result["samples"]
    ]
    result["figures"] = figures(samples)
    path.write_text(json.dumps(result, indent=2) + "\n")
    report(samples, path, result["title"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=PROXY_MODES, default="nftables")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--every", type=float, default=15.0, help="seconds between samples")
    parser.add_argument("--max-replicas", type=int, default=15)
    parser.add_argument("--redraw", type=Path, help="a result file: its figures and chart again")
    record.add_json_option(parser)
    options = parser.parse_args()
    if options.redraw:
        redraw(options.redraw)
        return
    began_at = record.revision()
    folder = ROOT / "build" / "soak" / time.strftime("%Y-%m-%dT%H%M")
    lab = Lab(unique_name("knit-soak"), folder / "lab", options.mode)
    try:
        lab.up()
        samples = soak(lab, folder / "run", options.minutes, options.every, options.max_replicas)
    finally:
        lab.down()
    path = record.result_path(options.json, "soak")
    title = (
        f"knit-proxyd over {options.minutes:g} minutes of churn, {options.mode} mode "
        f"({time.strftime('%Y-%m-%d')}, {began_at})"
    )
    record.write(
        path, figures(samples), began_at, title=title, samples=[asdict(s) for s in samples]
    )
    report(samples, path, title)


if __name__ == "__main__":
    main()
