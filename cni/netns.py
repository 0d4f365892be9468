"""Entering a network namespace from the calling thread, the way runtimes hand one over."""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager

from cni.errors import CniError, Code

CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def open_netns(path: str) -> int:
    """An fd for the namespace at path; CniError 3 when the container's netns is gone."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as err:
        raise CniError(Code.UNKNOWN_CONTAINER, f"network namespace {path} does not exist") from err
    except OSError as err:
        raise CniError(Code.IO_FAILURE, f"cannot open network namespace {path}: {err}") from err


@contextmanager
def entered(netns_fd: int) -> Iterator[None]:
    """Run the block with this thread inside the namespace, then return to where it was."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            _setns(netns_fd)
        except OSError as err:
            code = Code.UNKNOWN_CONTAINER if err.errno == errno.EINVAL else Code.IO_FAILURE
            raise CniError(code, f"cannot enter network namespace: {err}") from err
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(home)
