"""The large-cluster model's arithmetic (bench/scale_model.py): the cluster's event rates, what
each kind of daemon receives and costs, and the inputs read from a watch-cost result file."""

from __future__ import annotations

import pytest

from bench.scale_model import (
    Assumptions,
    Measured,
    Watcher,
    cost,
    event_rates,
    measured_from,
    table,
)

WATCHER = Watcher(
    pod_event_bytes=2_500.0,
    slice_event_bytes=1_500.0,
    rss_mib=0.5,
    goroutines=25.0,
    list_ms=300.0,
    listed_mib=100.0,
)
MEASURED = Measured(
    pods=10_000,
    pod_json_bytes=2_500.0,
    event_us=20.0,
    mib_per_10k_pods=40.0,
    knit=WATCHER,
    kube_proxy=Watcher(2.0, 1_500.0, 0.25, 10.0, 20.0, 60.0),
)


def test_the_event_rates_follow_the_churn_and_the_nodes() -> None:
    rates = event_rates(1000, Assumptions())
    assert rates == pytest.approx({"pod": 240.0, "slice": 90.0, "node": 1000 / 300})
    assert event_rates(5000, Assumptions(pod_starts_per_1000_nodes=3.0))["pod"] == 120.0


def test_a_knit_daemon_receives_every_pod_slice_and_node_event() -> None:
    found = cost("knit", 1000, MEASURED, Assumptions())
    assert found.events_per_node == pytest.approx(240 + 90 + 1000 / 300)
    per_node_bytes = 240 * 2_500 + 90 * 1_500 + 1000 / 300 * 10_000
    assert found.egress_mb == pytest.approx(1000 * per_node_bytes / 1e6)
    # a Node event's CPU is a pod event's, per byte
    per_node_us = 240 * 20 + 90 * 20 + 1000 / 300 * 20 * 10_000 / 2_500
    assert found.cpu_cores == pytest.approx(1000 * per_node_us / 1e6)
    assert found.watch_rss_gib == pytest.approx(1000 * 0.5 / 1024)
    assert found.goroutines == 25_000
    # the first lists grow with the pods: 30,000 here against the bench's 10,000
    assert found.relist_core_seconds == pytest.approx(1000 * 0.3 * 3)
    assert found.daemon_mib == pytest.approx(100 + 2 * 40)


def test_a_kube_proxy_receives_the_slices_and_its_own_node_only() -> None:
    found = cost("kube_proxy", 5000, MEASURED, Assumptions())
    assert found.events_per_node == pytest.approx(5 * 90 + 1 / 300)
    assert found.egress_mb == pytest.approx(5000 * (450 * 1_500 + 10_000 / 300) / 1e6)
    assert found.cpu_cores == pytest.approx(5000 * (450 * 20 + 20 * 4 / 300) / 1e6)
    assert found.relist_core_seconds == pytest.approx(5000 * 0.02)
    assert found.daemon_mib == 60


def test_the_table_puts_each_figure_beside_kube_proxys() -> None:
    lines = table(MEASURED, Assumptions(), [1000]).splitlines()
    assert lines[0].startswith(
        "| figure | 1,000 nodes: knit | 1,000 nodes: kube-proxy | 1,000 nodes: ratio"
    )
    assert lines[2].startswith("| watch events each daemon receives (/s) | 333 | 90 | 4x |")


def test_the_inputs_are_the_fits_and_the_largest_number_of_watchers() -> None:
    def beside(key: str, knit: float, proxy: float, watchers: int = 0) -> dict[str, object]:
        return {"key": key, "watchers": watchers, "knit": knit, "kube_proxy": proxy}

    figures = [
        {"key": "cluster", "pods": 10_000},
        {"key": "pod_json_bytes", "bytes": 2_569},
        beside("fit_pod_change_cpu_us", 30.0, -1.0),
        beside("fit_slice_change_cpu_us", 12.0, 60.0),
        beside("fit_rss_mib", 4.0, 2.0),
        beside("fit_goroutines", 25.0, 10.0),
        beside("fit_list_cpu_ms", 250.0, 15.0),
        *(
            item
            for n in (1, 10)
            for item in (
                beside("pod_change_received_bytes", 2_700.0 + n, 1.4, n),
                beside("slice_change_received_bytes", 1_700.0, 1_690.0, n),
                beside("watcher_listed_mib", 90.0 + n, 60.0, n),
                {"key": "watcher_per_10k_pods_mib", "watchers": n, "mib": 30.0 + n},
            )
        ),
    ]
    measured = measured_from({"figures": figures})
    assert measured.pods == 10_000
    assert measured.pod_json_bytes == 2_569
    # the events a watcher receives: pods to knit's kind, slices to both
    assert measured.event_us == pytest.approx((30 + 12 + 60) / 3)
    assert measured.mib_per_10k_pods == 40.0
    assert measured.knit == Watcher(2_710.0, 1_700.0, 4.0, 25.0, 250.0, 100.0)
    assert measured.kube_proxy.listed_mib == 60.0
