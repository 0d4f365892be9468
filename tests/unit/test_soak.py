"""The soak's pure parts (bench/soak.py): reading knit-proxyd's sync histograms, the mean
sync time between samples, and whether a figure stayed flat."""

from __future__ import annotations

from bench.soak import Sample, figures, histogram_totals, mean_syncs

PAGE = """
# TYPE kubeproxy_sync_proxy_rules_duration_seconds histogram
kubeproxy_sync_proxy_rules_duration_seconds_bucket{family="ipv4",le="0.001"} 1.0
kubeproxy_sync_proxy_rules_duration_seconds_sum{family="ipv4"} 0.5
kubeproxy_sync_proxy_rules_duration_seconds_count{family="ipv4"} 10.0
kubeproxy_sync_proxy_rules_duration_seconds_sum{family="ipv6"} 0.25
kubeproxy_sync_proxy_rules_duration_seconds_count{family="ipv6"} 5.0
knit_network_policy_sync_duration_seconds_sum 0.1
knit_network_policy_sync_duration_seconds_count 4.0
"""


def _sample(minute: float, rss_kib: int, proxy: tuple[float, float]) -> Sample:
    syncs = {"proxy sync": proxy, "policy sync": (0.0, 0.0)}
    return Sample(minute, "node1", rss_kib, 20, 30, syncs)


def test_a_histogram_is_summed_over_both_families() -> None:
    assert histogram_totals(PAGE, "kubeproxy_sync_proxy_rules_duration_seconds") == (0.75, 15.0)
    assert histogram_totals(PAGE, "knit_network_policy_sync_duration_seconds") == (0.1, 4.0)


def test_the_mean_sync_time_is_taken_between_samples_and_starts_over_after_a_restart() -> None:
    samples = [
        _sample(0, 1000, (1.0, 10)),
        _sample(1, 1000, (1.5, 20)),  # 10 syncs, 0.5 s: 50 ms
        _sample(2, 1000, (1.5, 20)),  # none
        _sample(3, 1000, (0.1, 1)),  # the counters went back: not a mean
        _sample(4, 1000, (0.3, 5)),  # 4 syncs, 0.2 s: 50 ms
    ]
    assert [(m, round(v, 3)) for m, v in mean_syncs(samples, "proxy sync")] == [
        (1, 50.0),
        (4, 50.0),
    ]


def test_memory_that_grows_past_five_percent_is_not_flat() -> None:
    flat = [_sample(minute, 100_000, (minute, minute * 10)) for minute in range(21)]
    grown = [
        _sample(minute, 100_000 + 1000 * minute, (minute, 10 * minute)) for minute in range(21)
    ]
    memory = {row["step"]: row["goal"] for row in figures(flat) if "memory" in row["figure"]}
    assert memory == {"node1": "growth < 5%: met"}
    memory = {row["step"]: row["goal"] for row in figures(grown) if "memory" in row["figure"]}
    assert memory == {"node1": "growth < 5%: NOT met"}


def test_a_window_s_sync_time_is_its_syncs_time_over_their_number() -> None:
    # minutes 5-10: one slow sync in one sample, thirty quick ones in the other
    samples = [_sample(minute, 100_000, (0.0, 0)) for minute in range(5)]
    samples += [_sample(5, 100_000, (0.0, 0)), _sample(6, 100_000, (1.0, 1))]
    samples += [_sample(7, 100_000, (1.3, 31))]
    samples += [
        _sample(minute, 100_000, (1.3 + 0.1 * minute, 31 + 10 * minute)) for minute in (15, 20)
    ]
    rows = {row["figure"]: row["knit"] for row in figures(samples)}
    # (1.3 s / 31 syncs) = 41.9 ms, where the median of the samples' means would be 505
    assert rows["proxy sync time, mean: minutes 5-10 -> last 5"].startswith("41.9 -> 10.0")
