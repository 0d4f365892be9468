"""The proxy bench's chart: knit's cost against kube-proxy's per figure, a row kube-proxy did
not finish written under the chart instead of drawn."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench import chart


def beside(mode: str, size: int, figure: str, knit: str, anchor: str, ratio: str) -> dict[str, Any]:
    return {
        "mode": mode,
        "size": size,
        "figure": chart.BESIDE + figure,
        "knit": knit,
        "anchor": anchor,
        "ratio": ratio,
        "goal": "",
    }


FIGURES = [
    beside("nftables", 1000, "first full sync (metric)", "0.16 s", "kube-proxy 0.28 s", "0.57x"),
    beside("nftables", 10000, "first full sync (metric)", "1.13 s", "kube-proxy 15.53 s", "0.07x"),
    beside("iptables", 10000, "first full sync (metric)", "12.12 s", "kube-proxy not done", ""),
    beside(
        "nftables",
        10000,
        "TCP connections/s via ClusterIP, as a share of direct",
        "0.80x",
        "kube-proxy 0.82x",
        "0.50x",
    ),
    {
        "mode": "nftables",
        "size": 10000,
        "figure": "full sync",
        "knit": "1 s",
        "anchor": "",
        "ratio": "",
    },
]


def test_costs_keep_the_largest_size_and_invert_connection_rates() -> None:
    largest, by_figure, unmeasured = chart.costs(FIGURES)
    assert largest == 10000
    assert by_figure == {
        "first full sync (metric)": {"nftables": 0.07},
        "TCP connections/s via ClusterIP, as a share of direct": {"nftables": 2.0},
    }
    assert unmeasured == [
        "iptables mode, first full sync (metric): knit 12.12 s, kube-proxy not done"
    ]


def test_a_result_with_an_unfinished_row_is_drawn(tmp_path: Path) -> None:
    result = tmp_path / "proxy.json"
    result.write_text(json.dumps({"date": "2026-11-26", "commit": "abc", "figures": FIGURES}))
    chart.draw(result, tmp_path / "proxy.png")
    assert (tmp_path / "proxy.png").read_bytes().startswith(b"\x89PNG")
