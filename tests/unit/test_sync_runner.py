"""The bounded-frequency runner, driven by a clock the test moves (no sleeping), and its loop
thread once."""

from __future__ import annotations

import itertools
import threading

from proxyd.runner import BoundedFrequencyRunner, backoff


class Clock:
    """Moved by the test; steps and intervals are binary fractions, so sums stay exact."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def runner_with_runs(
    clock: Clock, min_interval: float, max_interval: float, burst: int = 2
) -> tuple[BoundedFrequencyRunner, list[float]]:
    runs: list[float] = []
    runner = BoundedFrequencyRunner(
        lambda: runs.append(clock.now), min_interval, max_interval, burst=burst, clock=clock
    )
    return runner, runs


def advance(clock: Clock, runner: BoundedFrequencyRunner, seconds: float, step: float) -> None:
    """Let the runner look at the clock now and after each step, up to `seconds` on."""
    for _ in range(round(seconds / step)):
        runner.poll()
        clock.now += step
    runner.poll()


def test_a_storm_of_requests_coalesces_under_the_minimum_interval() -> None:
    clock = Clock()
    runner, runs = runner_with_runs(clock, 0.25, 60, burst=1)
    for _ in range(48):  # requests every 1/64 s for 0.75 s
        runner.run()
        runner.poll()
        clock.now += 1 / 64
    advance(clock, runner, 1.0, 1 / 64)
    assert runs == [0.0, 0.25, 0.5, 0.75], "the first at once, then one per minimum interval"
    assert all(b - a >= 0.25 for a, b in itertools.pairwise(runs))


def test_a_burst_runs_back_to_back_then_waits() -> None:
    clock = Clock()
    runner, runs = runner_with_runs(clock, 1.0, 60, burst=2)
    for _ in range(3):
        runner.run()
        runner.poll()
    assert runs == [0.0, 0.0]
    advance(clock, runner, 2.0, 1 / 8)
    assert runs == [0.0, 0.0, 1.0], "the burst spent: the third waits a whole interval"


def test_without_requests_it_runs_at_the_maximum_interval() -> None:
    clock = Clock()
    runner, runs = runner_with_runs(clock, 0, 0.25)
    advance(clock, runner, 0.875, 1 / 16)
    assert runs == [0.25, 0.5, 0.75]


def test_a_retry_waits_for_the_rate_limit() -> None:
    clock = Clock()
    runner, runs = runner_with_runs(clock, 0.25, 60, burst=1)
    runner.run()
    assert runner.poll() and runs == [0.0]
    runner.retry_after(0)
    advance(clock, runner, 0.5, 1 / 16)
    assert runs == [0.0, 0.25]


def test_a_retry_comes_at_its_time_when_the_limit_allows() -> None:
    clock = Clock()
    runner, runs = runner_with_runs(clock, 0.125, 60, burst=1)
    runner.retry_after(2.0)
    advance(clock, runner, 3.0, 1 / 2)
    assert runs == [2.0]


def test_the_loop_thread_syncs_on_request_and_stops() -> None:
    synced = threading.Event()
    runner = BoundedFrequencyRunner(synced.set, 0, 60)
    thread = threading.Thread(target=runner.loop)
    thread.start()
    try:
        runner.run()
        assert synced.wait(5)
    finally:
        runner.stop()
        thread.join(5)
    assert not thread.is_alive()


def test_backoff_doubles_from_the_first_delay_to_a_minute() -> None:
    assert [backoff(n, 1.0) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert backoff(1, 5.0) == 5 and backoff(0, 1.0) == 1
