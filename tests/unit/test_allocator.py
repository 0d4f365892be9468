"""The daemon's allocator setting (proxyd.allocator), in a fresh interpreter each: a sync's few
MiB, freed, stay with the process for the next sync rather than going back to the kernel."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import ctypes, sys
from proxyd import allocator
if sys.argv[1] == "tuned":
    allocator.keep_sync_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
size = 3 << 20
block = libc.malloc(size)
ctypes.memset(block, 1, size)
held = rss()
libc.free(block)
print(held - rss())
"""


def given_back_kib(how: str) -> int:
    """KiB of resident memory a freed 3-MiB block gave back at once."""
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, how], capture_output=True, text=True, check=True
    )
    return int(done.stdout)


@pytest.mark.skipif(sys.platform != "linux", reason="glibc's allocator")
def test_a_syncs_freed_memory_is_kept_for_the_next_sync() -> None:
    assert given_back_kib("default") >= 2048, "glibc's default gives a 3-MiB block back"
    assert given_back_kib("tuned") < 512, "kept, under the fixed thresholds"
