"""A bounded-frequency runner: syncs at most `burst` times back to back, then no more often
than every `min_interval`; at least every `max_interval`; requests in between coalesce.
Every sync, whether asked for, a retry or the periodic one, takes a token (kube-proxy's
runner, where retries and the periodic timer also go through the limiter)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

RETRY_LONGEST = 60.0
IDLE = 3600.0
"""The longest interval of a worker that runs only when asked (a walk without a change finds
nothing to do)."""


def backoff(failures: int, first: float) -> float:
    """Seconds before retrying a sync that failed `failures` times in a row: `first`, then
    doubling up to RETRY_LONGEST, so that what the kernel keeps refusing is not rewritten
    every second, forever."""
    return min(RETRY_LONGEST, first * 2.0 ** max(0, failures - 1))


class BoundedFrequencyRunner:
    def __init__(
        self,
        fn: Callable[[], None],
        min_interval: float,
        max_interval: float,
        burst: int = 2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fn = fn
        self._min = min_interval
        self._max = max_interval
        self._burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()
        self._last_run = clock()
        self._requested = False
        self._retry_at: float | None = None
        self._cond = threading.Condition()
        self._stopped = False

    def run(self) -> None:
        """Ask for a sync as soon as the rate limit allows."""
        with self._cond:
            # a request already pending is in the loop's deadline, or will be read when the
            # sync under way returns: waking the loop at every event of a burst would cost a
            # thread switch each, for nothing
            if not self._requested:
                self._requested = True
                self._cond.notify()

    def retry_after(self, delay: float) -> None:
        """Ask for a sync after `delay` seconds (after a failure)."""
        with self._cond:
            at = self._clock() + delay
            self._retry_at = at if self._retry_at is None else min(self._retry_at, at)
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def _refill(self, now: float) -> None:
        if self._min > 0:
            self._tokens = min(self._burst, self._tokens + (now - self._stamp) / self._min)
        else:
            self._tokens = float(self._burst)
        self._stamp = now

    def _next_deadline(self, now: float) -> float:
        """When the loop must wake up next: the earliest reason to sync (the maximum interval,
        a retry, a request), but never before the rate limit has a token for it."""
        due = self._last_run + self._max
        if self._retry_at is not None:
            due = min(due, self._retry_at)
        if self._requested:
            due = now
        allowed = now if self._tokens >= 1 else now + (1 - self._tokens) * self._min
        return max(due, allowed)

    def _take_if_due(self) -> float | None:
        """Under the lock: None when a sync is due now (its token taken, the requests it
        answers cleared), else the seconds until the next reason to look again."""
        now = self._clock()
        self._refill(now)
        deadline = self._next_deadline(now)
        if deadline > now:
            return deadline - now
        self._tokens = max(0.0, self._tokens - 1)
        self._requested = False
        self._retry_at = None
        self._last_run = now
        return None

    def poll(self) -> bool:
        """Sync now if a sync is due by the clock; whether it did. loop() is this, waiting in
        between; tests drive it with their own clock."""
        with self._cond:
            if self._stopped or self._take_if_due() is not None:
                return False
        self._fn()
        return True

    def start(self, name: str) -> threading.Thread:
        """Run loop() on a daemon thread of its own, named `name`."""
        thread = threading.Thread(target=self.loop, name=name, daemon=True)
        thread.start()
        return thread

    def loop(self) -> None:
        """Run until stop(); call from the thread that should do the syncs."""
        while True:
            with self._cond:
                while True:
                    if self._stopped:
                        return
                    wait = self._take_if_due()
                    if wait is None:
                        break
                    self._cond.wait(wait)
            self._fn()
