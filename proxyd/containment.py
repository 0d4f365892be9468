"""Pure: finding the objects whose rules the kernel refuses, so that a refusal stays with them.

A sync that the kernel refuses whole is asked again in halves, each a dry run of the rules of
part of the objects, until each refused part is one object. Those objects are then left out
of the rules (a Service is not served, a pod is quarantined) and the rest are written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


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
