"""glibc's allocator, tuned for a daemon whose syncs allocate the same few MiB again and again.

By default glibc gives the free memory at the top of the main heap back to the kernel once it
passes 128 KiB (raised only when a large mmapped block is freed), so each partial sync's
working memory (rendered rules, libnftables' cache of the table) was handed back after it and
faulted in again by the next: ~740 page faults per one-service change at 100 services, half of
the sync's time. Whether it happened at all hung on which threads happened to share the main
heap: starting one more idle thread (the conntrack reconciler's) took a partial sync from 2.1
to 4.3 ms (docs/benchmarks.md#where-knit-proxyds-fixed-cost-goes).

A fixed trim threshold keeps up to TRIM_THRESHOLD at the top instead; setting it turns glibc's
moving mmap threshold off, so that one is fixed too, at MMAP_THRESHOLD. A full sync's larger
memory is still given back after it (cni.kernel.nftables.malloc_trim).
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""mallopt's parameters (malloc.h)."""
TRIM_THRESHOLD = 8 << 20
MMAP_THRESHOLD = 4 << 20
"""Blocks this large or larger get mappings of their own, returned when freed."""


def keep_sync_memory() -> None:
    """Set the thresholds, where the C library is glibc (others lack mallopt, or mean
    something else by it: nothing is set there)."""
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        log.info("not glibc: the allocator's thresholds are left as they are")
        return
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    for parameter, value in (
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
    ):
        if not libc.mallopt(parameter, value):
            log.warning("glibc refused mallopt(%d, %d)", parameter, value)
