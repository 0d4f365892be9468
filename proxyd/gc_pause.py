"""Python's cyclic garbage collector around syncs.

A sync allocates hundreds of thousands of small acyclic objects (plans, rendered rules,
claims), and each collection they trigger walks every object still alive, a large share of a
full sync's Python. So a sync runs with the collector held off, and the collection it put off,
itself a walk of the whole heap, runs at a known moment after a full sync, once its metrics
are recorded, rather than whenever the heap's growth next triggers it, possibly inside a
partial sync. The informers' lists are read and parsed with the collector held off too. The
figures: docs/benchmarks.md#nftables-mode-the-full-syncs-python-and-nfts-own-time.

The switch is process-wide and pauses overlap (an informer's list ends by queueing the first
sync, which starts while that pause lasts), so pauses are counted: the collector stays off
until the last one ends.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_pauses = 0
_enabled_before = False
"""Whether the collector was on when the first of the pauses under way began."""


@contextmanager
def paused() -> Iterator[None]:
    """Hold the collector off until every pause under way, in any thread, has ended; then
    leave it as it was before the first of them."""
    global _pauses, _enabled_before
    with _lock:
        if not _pauses:
            _enabled_before = gc.isenabled()
            gc.disable()
        _pauses += 1
    try:
        yield
    finally:
        with _lock:
            _pauses -= 1
            if not _pauses and _enabled_before:
                gc.enable()


def collect_deferred() -> None:
    """The full collection a full sync put off, unless another pause is under way: an
    explicit collection runs whether the collector is off or not, holding the interpreter
    for as long as it walks the heap, and would stall that other sync (the policy's first
    one runs beside the proxy's at start, with 10,000 pods in the heap). The collector, on
    again when the last pause ends, then collects as its thresholds say."""
    with _lock:
        if _pauses:
            return
    gc.collect()
