"""Pure: finding the objects whose rules the kernel refuses, so that a refusal stays with them.

A sync that the kernel refuses whole is asked again in halves, each a dry run of the rules of
part of the objects, until each refused part is one object. Those objects are then left out
of the rules (a Service is not served, a pod is quarantined) and the rest are written, and
Held keeps them out.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Generic, TypeVar

from proxyd.runner import backoff

T = TypeVar("T")
K = TypeVar("K", bound=Hashable)

FIRST_HOLD = 1.0
"""Seconds an object's first refusal holds it out at least, doubling with each refusal of the
same object (runner.backoff)."""


class Held(Generic[K]):
    """The objects left out because the kernel refused their rules, each with what it wanted
    then. One stays out while it wants the same, and at least until its hold runs out, which
    doubles each time the kernel refuses the same object again: an owner editing a refused
    object at every turn costs a full write and a search each time, so not more often than
    that. An object gone is forgotten."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._held: dict[K, tuple[object, float]] = {}
        self._strikes: Counter[K] = Counter()

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._held))

    def __contains__(self, key: object) -> bool:
        return key in self._held

    def hold(self, key: K, wanted: object) -> bool:
        """Leave `key` out, as it wants `wanted`; whether it was not out already."""
        if key in self._held:
            return False
        self._strikes[key] += 1
        self._held[key] = (wanted, self._clock() + backoff(self._strikes[key], FIRST_HOLD))
        return True

    def keeps(self, key: K, wanted: object | None) -> bool:
        """Whether `key`, wanting `wanted` now (None: gone), stays out."""
        if key not in self._held:
            return False
        if wanted is None:
            del self._held[key]
            self._strikes.pop(key, None)
            return False
        refused_wanting, until = self._held[key]
        if wanted == refused_wanting or self._clock() < until:
            return True
        del self._held[key]
        return False


class Unprogrammable(RuntimeError):
    """The kernel refuses the rules even without any object's own."""


def refused(objects: Sequence[T], accepts: Callable[[Sequence[T]], bool]) -> list[T]:
    """The objects whose rules make the kernel refuse the whole, by halving; [] when it takes
    them all (the refusal passed). `accepts`: whether a dry run of the rules with only these
    objects' passes. Where two halves pass alone but not together, all of that part is
    refused: leaving out more objects fails closed, guessing fewer could not load.
    Raises Unprogrammable when the rules are refused without any object."""
    if accepts(objects):
        return []
    if not accepts(()):
        raise Unprogrammable("the kernel refuses the rules even without any object's own")

    def search(part: Sequence[T]) -> list[T]:
        if len(part) == 1:
            return list(part)
        half = len(part) // 2
        found: list[T] = []
        for side in (part[:half], part[half:]):
            if not accepts(side):
                found += search(side)
        return found or list(part)

    return search(objects)
