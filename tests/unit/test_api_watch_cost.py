"""The watch-cost bench's pure parts (bench/api_watch_cost.py): reading the API server's
watch metrics, the slope over the numbers of watchers, and the sizes it derives."""

from __future__ import annotations

import os

import pytest

from bench.api_watch_cost import cpu_seconds, nodes_for, parse_metrics, slope, watch_bytes

PAGE = """
# HELP apiserver_watch_events_sizes [ALPHA] Watch event size distribution in bytes
# TYPE apiserver_watch_events_sizes histogram
apiserver_watch_events_sizes_bucket{group="",resource="pods",version="v1",le="1024"} 3
apiserver_watch_events_sizes_sum{group="",resource="pods",version="v1"} 7000
apiserver_watch_events_sizes_count{group="",resource="pods",version="v1"} 3
apiserver_watch_events_sizes_sum{group="discovery.k8s.io",resource="endpointslices"} 900
apiserver_watch_events_total{group="",kind="Pod",version="v1"} 5
apiserver_watch_list_duration_seconds_sum{group="",resource="pods",scope="cluster"} 1
go_memstats_heap_inuse_bytes 1.2e+08
go_memstats_heap_inuse_bytes_total 3
"""


def test_the_watch_metrics_are_read_per_resource_and_the_heap_alone() -> None:
    found = parse_metrics(
        PAGE,
        (
            "apiserver_watch_events_sizes",
            "apiserver_watch_events_total",
            "go_memstats_heap_inuse_bytes",
        ),
    )
    assert found["apiserver_watch_events_sizes_sum:pods"] == 7000
    assert found["apiserver_watch_events_sizes_count:pods"] == 3
    assert found["apiserver_watch_events_sizes_sum:endpointslices"] == 900
    # older API servers label the events by kind
    assert found["apiserver_watch_events_total:pod"] == 5
    assert found["go_memstats_heap_inuse_bytes"] == 1.2e8
    assert not any("bucket" in key or "list_duration" in key for key in found)


def test_the_watch_bytes_between_two_scrapes_count_a_resource_missing_before_as_none() -> None:
    after = parse_metrics(PAGE, ("apiserver_watch_events_sizes",))
    assert watch_bytes({}, after, "pods") == 7000
    assert watch_bytes(after, after, "pods") == 0
    assert watch_bytes(after, after, "nodes") == 0


def test_the_slope_is_the_least_squares_one() -> None:
    assert slope([(0, 10.0), (1, 12.0), (10, 30.0), (50, 110.0)]) == pytest.approx(2.0)
    # noise at few watchers weighs little beside many
    assert slope([(0, 10.0), (1, 8.0), (10, 30.0), (50, 110.0)]) == pytest.approx(2.0, rel=0.02)
    with pytest.raises(ValueError):
        slope([(1, 1.0), (1, 2.0)])


def test_the_nodes_hold_the_pods_rounded_up() -> None:
    assert nodes_for(10_000, 30) == 334
    assert nodes_for(30, 30) == 1
    assert nodes_for(0, 30) == 1


def test_a_process_cpu_time_is_read_from_its_stat() -> None:
    assert cpu_seconds(os.getpid()) > 0
