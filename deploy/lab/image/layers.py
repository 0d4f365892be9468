"""Layers: the changes from one rootfs tree to the next as a gzip tar blob in the cache, or
entries given one by one (Member: a file to copy, bytes, a directory, a symlink).

A layer holds what is new or changed (a changed file whole; metadata, extended attributes and
contents compared, so equal trees give byte-equal blobs) and a whiteout for what went; never
device nodes, FIFOs or sockets (the runtime makes /dev). Entries carry no user or group names
and whole-second times, so a layer depends on its tree alone.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.lab.image.cache import Layer, blob_path, new_blob_path

# The only extended attribute Debian's packages set (iputils-ping's cap_net_raw).
XATTRS = ("security.capability",)
GZIP_LEVEL = 6


class _HashingWriter(io.RawIOBase):
    """A write-only stream that hashes and counts what passes through to `target`."""

    def __init__(self, target: io.BufferedIOBase) -> None:
        self.target = target
        self.sha256 = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha256.update(view)
        self.target.write(view)
        self.size += view.nbytes
        return view.nbytes


def _special(mode: int) -> bool:
    """Device nodes, FIFOs and sockets: never in a layer (the runtime makes /dev)."""
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))


def _xattrs(path: Path) -> dict[str, bytes]:
    found = {}
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:
        return {}
    for name in names:
        if name in XATTRS:
            found[name] = os.getxattr(path, name, follow_symlinks=False)
    return found


@dataclass
class _Entry:
    path: str  # relative to the tree, "/"-separated
    whiteout: bool = False


def _listdir(directory: Path | None) -> dict[str, os.stat_result]:
    if directory is None:
        return {}
    entries = {}
    with os.scandir(directory) as it:
        for entry in it:
            st = entry.stat(follow_symlinks=False)
            if not _special(st.st_mode):
                entries[entry.name] = st
    return entries


def _same_file(a: Path, b: Path) -> bool:
    with a.open("rb") as fa, b.open("rb") as fb:
        while True:
            chunk = fa.read(1 << 20)
            if chunk != fb.read(1 << 20):
                return False
            if not chunk:
                return True


def _unchanged(lower: Path, lst: os.stat_result, upper: Path, ust: os.stat_result) -> bool:
    def meta(st: os.stat_result) -> tuple[int, ...]:
        return (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid)

    if meta(lst) != meta(ust) or _xattrs(lower) != _xattrs(upper):
        return False
    if stat.S_ISLNK(ust.st_mode):
        return os.readlink(lower) == os.readlink(upper)
    if lst.st_mtime_ns != ust.st_mtime_ns:
        return False
    if stat.S_ISREG(ust.st_mode):
        return lst.st_size == ust.st_size and _same_file(lower, upper)
    return True


def tree_changes(upper: Path, lower: Path | None = None, prefix: str = "") -> Iterator[_Entry]:
    """What a layer over `lower` needs for `upper`: new and changed entries (a new directory
    with everything in it), and a whiteout for what `upper` no longer has; parents first,
    names sorted. With no `lower`, the whole tree."""
    up_dir = upper / prefix if prefix else upper
    low_dir = (lower / prefix if prefix else lower) if lower is not None else None
    ups, lows = _listdir(up_dir), _listdir(low_dir)
    for name in sorted(ups.keys() | lows.keys()):
        rel = f"{prefix}/{name}" if prefix else name
        if name not in ups:
            yield _Entry(f"{prefix}/.wh.{name}" if prefix else f".wh.{name}", whiteout=True)
            continue
        ust, lst = ups[name], lows.get(name)
        if lst is not None and stat.S_IFMT(lst.st_mode) != stat.S_IFMT(ust.st_mode):
            lst = None  # replaced by another kind of file: the applier removes the old one
        if (
            lst is None
            or low_dir is None
            or not _unchanged(low_dir / name, lst, up_dir / name, ust)
        ):
            yield _Entry(rel)
        if stat.S_ISDIR(ust.st_mode):
            yield from tree_changes(upper, lower if lst is not None else None, rel)


def _tarinfo(tar: tarfile.TarFile, path: Path, arcname: str) -> tarfile.TarInfo:
    info = tar.gettarinfo(str(path), arcname)
    info.mtime = int(info.mtime)
    info.uname = info.gname = ""
    xattrs = {
        "SCHILY.xattr." + name: value.decode("utf-8", "surrogateescape")
        for name, value in _xattrs(path).items()
    }
    # typeshed types pax_headers as a read-only Mapping: a new dict, not an update in place
    info.pax_headers = {**info.pax_headers, **xattrs}
    return info


@dataclass
class Member:
    """A layer entry not taken from a tree: a file's bytes (or a file to copy), a directory
    or a symlink."""

    name: str
    kind: str  # "file", "dir" or "symlink"
    mode: int = 0o755
    data: bytes = b""
    source: Path | None = None
    target: str = ""


def write_layer(
    comment: str,
    tree: Path | None = None,
    lower: Path | None = None,
    members: Sequence[Member] = (),
) -> Layer:
    """A gzip layer blob into the cache: the changes from `lower` to `tree`, or `members`."""
    tmp = new_blob_path()
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with tmp.open("wb") as raw:
        compressed = _HashingWriter(raw)
        with gzip.GzipFile(
            filename="", mode="wb", fileobj=compressed, compresslevel=GZIP_LEVEL, mtime=0
        ) as gz:
            plain = _HashingWriter(gz)
            with tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                if tree is not None:
                    for entry in tree_changes(tree, lower):
                        if entry.whiteout:  # an empty file
                            add_member(tar, Member(entry.path, "file", mode=0o644))
                            continue
                        info = _tarinfo(tar, tree / entry.path, entry.path)
                        if info.isreg():
                            with (tree / entry.path).open("rb") as f:
                                tar.addfile(info, f)
                        else:
                            tar.addfile(info)
                for member in members:
                    add_member(tar, member)
    digest = "sha256:" + compressed.sha256.hexdigest()
    target = blob_path(digest)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp.replace(target)
    return Layer(digest, "sha256:" + plain.sha256.hexdigest(), compressed.size, comment)


def add_member(tar: tarfile.TarFile, member: Member) -> None:
    """`member` into a tar: a layer's, or an OCI archive's."""
    info = tarfile.TarInfo(member.name)
    info.mode = member.mode
    if member.kind == "dir":
        info.type = tarfile.DIRTYPE
        tar.addfile(info)
    elif member.kind == "symlink":
        info.type = tarfile.SYMTYPE
        info.linkname = member.target
        tar.addfile(info)
    elif member.source is not None:
        info.size = member.source.stat().st_size
        with member.source.open("rb") as f:
            tar.addfile(info, f)
    else:
        info.size = len(member.data)
        tar.addfile(info, io.BytesIO(member.data))
