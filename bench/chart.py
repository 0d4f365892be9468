"""knit-proxyd beside kube-proxy, drawn from a proxy bench result file: for each figure both
give at the largest number of services, one bar per proxy mode, the length being what knit
costs against kube-proxy (its time, memory or CPU over kube-proxy's; for connections/s, where
more is better, kube-proxy's over knit's), on a log scale, so a bar left of 1 is knit ahead.

The proxy bench draws it beside its result file; by hand:
  .venv/bin/python -m bench.chart docs/results/<date>-proxy.json [--out chart.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt
from matplotlib import ticker

BESIDE = "beside kube-proxy: "
MORE_IS_BETTER = "TCP connections/s"
"""The figure whose ratio is inverted, so that every bar reads the same way."""


def costs(figures: list[dict[str, Any]]) -> tuple[int, dict[str, dict[str, float]], list[str]]:
    """(the largest N, figure -> mode -> knit's cost against kube-proxy's, the rows without a
    ratio as text) of the rows set beside kube-proxy."""
    rows = [row for row in figures if row["figure"].startswith(BESIDE)]
    if not rows:
        raise SystemExit("no figures beside kube-proxy in this file")
    largest = max(row["size"] for row in rows)
    by_figure: dict[str, dict[str, float]] = {}
    unmeasured = []
    for row in rows:
        if row["size"] != largest:
            continue
        name = row["figure"].removeprefix(BESIDE)
        # A row kube-proxy did not finish ("not done within 600 s") has no ratio: it is
        # written under the chart rather than drawn as a bar of a made-up length.
        if not row["ratio"]:
            unmeasured.append(f"{row['mode']} mode, {name}: knit {row['knit']}, {row['anchor']}")
            continue
        factor = float(row["ratio"].removesuffix("x"))
        cost = 1 / factor if name.startswith(MORE_IS_BETTER) else factor
        by_figure.setdefault(name, {})[row["mode"]] = cost
    return largest, by_figure, unmeasured


def draw(result: Path, out: Path) -> None:
    record = json.loads(result.read_text())
    largest, by_figure, unmeasured = costs(record["figures"])
    names = list(by_figure)
    modes = sorted({mode for values in by_figure.values() for mode in values})
    height = 0.8 / len(modes)
    figure, axes = plt.subplots(figsize=(10, 0.55 * len(names) + 1.6))
    for index, mode in enumerate(modes):
        positions = [row + index * height for row in range(len(names))]
        values = [by_figure[name].get(mode, float("nan")) for name in names]
        bars = axes.barh(positions, values, height, label=f"{mode} mode")
        axes.bar_label(bars, labels=[f"{value:.2f}" for value in values], padding=3, fontsize=8)
    axes.axvline(1.0, color="black", linewidth=0.8)
    axes.set_xscale("log")
    axes.xaxis.set_major_locator(ticker.LogLocator(base=2))
    axes.xaxis.set_major_formatter(ticker.FuncFormatter(lambda value, _: f"{value:g}x"))
    axes.xaxis.set_minor_formatter(ticker.NullFormatter())
    axes.set_yticks([row + height * (len(modes) - 1) / 2 for row in range(len(names))])
    axes.set_yticklabels([wrapped(name) for name in names], fontsize=8)
    axes.invert_yaxis()
    axes.set_xlabel("knit-proxyd's cost against kube-proxy's (log scale; left of 1: knit ahead)")
    axes.set_title(
        f"knit-proxyd beside kube-proxy, {largest:,} services x 10 endpoints "
        f"({record['date']}, {record['commit']})",
        fontsize=10,
    )
    axes.legend(fontsize=8)
    if unmeasured:
        axes.set_xlabel(f"{axes.get_xlabel()}\nnot drawn: " + "; ".join(unmeasured), fontsize=8)
    figure.tight_layout()
    figure.savefig(out, dpi=110)
    plt.close(figure)
    print(f"chart drawn in {out}")


def wrapped(name: str, width: int = 48) -> str:
    lines, line = [], ""
    for word in name.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join([*lines, line])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path, help="a proxy bench result file")
    parser.add_argument("--out", type=Path, help="the PNG (default: the result's, .png)")
    options = parser.parse_args()
    draw(options.result, options.out or options.result.with_suffix(".png"))


if __name__ == "__main__":
    main()
