"""Entering a network namespace from the calling thread, the way runtimes hand one over."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager

from cni.kernel.errors import NetnsError

CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703  # _IO(0xb7, 0x3): the CLONE_NEW* kind of an nsfs descriptor
_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def open_netns(path: str, opened: int | None = None) -> int:
    """An fd of the caller's own for the namespace at path, or for the one opened already
    (the fast path's plugin opens CNI_NETNS); NetnsError, `gone` when the container's netns is
    gone or path is not a network namespace."""
    try:
        # O_NONBLOCK: opening a FIFO placed at path would otherwise wait for a writer forever;
        # an nsfs file ignores the flag
        flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
        fd = os.open(path, flags) if opened is None else os.dup(opened)
    except FileNotFoundError as err:
        raise NetnsError(f"network namespace {path} does not exist", gone=True) from err
    except OSError as err:
        raise NetnsError(f"cannot open network namespace {path}: {err}") from err
    if _namespace_kind(fd) != CLONE_NEWNET:
        os.close(fd)
        raise NetnsError(f"{path} is not a network namespace", gone=True)
    return fd


def _namespace_kind(fd: int) -> int | None:
    try:
        return fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError:
        return None  # not an nsfs file


@contextmanager
def entered(netns_fd: int) -> Iterator[None]:
    """Run the block with this thread inside the namespace, then return to where it was."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            _setns(netns_fd)
        except OSError as err:
            gone = err.errno == errno.EINVAL
            raise NetnsError(f"cannot enter network namespace: {err}", gone=gone) from err
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(home)
