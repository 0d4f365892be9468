"""A directory tree written as a newc cpio archive, the format the kernel unpacks an initramfs
from (so the build needs no cpio tool). Hard links are written as separate files."""

from __future__ import annotations

import itertools
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


def _pad(out: BinaryIO, length: int) -> None:
    out.write(b"\0" * (-length % 4))


def _entry(out: BinaryIO, ino: int, name: str, st: os.stat_result | None, data: bytes) -> None:
    mode, uid, gid, mtime = (st.st_mode, st.st_uid, st.st_gid, int(st.st_mtime)) if st else (0,) * 4
    encoded = name.encode() + b"\0"
    fields = (ino, mode, uid, gid, 1, mtime, len(data), 0, 0, 0, 0, len(encoded), 0)
    header = b"070701" + b"".join(b"%08X" % value for value in fields)
    out.write(header + encoded)
    _pad(out, len(header) + len(encoded))
    out.write(data)
    _pad(out, len(data))


def _walk(root: Path, relative: str) -> Iterator[tuple[str, Path]]:
    """(archive name, path) of root/relative and everything below it, parents first."""
    path = root / relative if relative != "." else root
    yield relative, path
    if path.is_dir() and not path.is_symlink():
        for child in sorted(os.listdir(path)):
            yield from _walk(root, child if relative == "." else f"{relative}/{child}")


def write_cpio(root: Path, archive: Path) -> None:
    """Write every entry under root (root itself as "."): files, directories, symlinks; other
    kinds (sockets, devices) are left out, the VM's devtmpfs has its devices."""
    inodes = itertools.count(1)
    with archive.open("wb") as out:
        for name, path in _walk(root, "."):
            st = path.lstat()
            if stat.S_ISLNK(st.st_mode):
                data = os.readlink(path).encode()
            elif stat.S_ISREG(st.st_mode):
                data = path.read_bytes()
            elif stat.S_ISDIR(st.st_mode):
                data = b""
            else:
                continue
            _entry(out, next(inodes), name, st, data)
        _entry(out, 0, "TRAILER!!!", None, b"")
