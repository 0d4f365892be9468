"""Network namespaces as the proxy bench uses them: fresh ones, and work run from inside one."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import TypeVar

from deploy.lab.netns import Netns, namespaces

T = TypeVar("T")


def in_netns(ns: Netns, fn: Callable[[], T]) -> T:
    """fn() run by a worker thread that entered ns (what it starts is in ns too); the calling
    thread stays where it is."""

    def entered_call() -> T:
        with ns.entered():
            return fn()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(entered_call).result()


def make_netns(prefix: str, stack: ExitStack) -> Netns:
    """A fresh network namespace (lo up), removed when stack closes."""
    return stack.enter_context(namespaces("kpb-"))(prefix)
