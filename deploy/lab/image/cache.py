"""The build cache, build/images/cache/: everything expensive the image build makes, kept under
keys of its inputs so that a warm build only hashes its inputs.

It holds every layer as a blob (blobs/sha256/HEX, named by its digest) and every step (a rootfs
tree, or none, and the layers it made) under steps/NAME-KEY; a step's other keys are removed
when it is rebuilt, and the blobs no step refers to at the end of a build. Removal here never
descends into a mount (a chroot's /proc), and one build at a time holds the cache's lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deploy.lab.image.errors import ImageError
from deploy.lab.paths import IMAGES

CACHE = IMAGES / "cache"
# Bump when a step's recipe changes in a way its other inputs do not show.
RECIPE = 2


def key(*parts: Any) -> str:
    """The cache key of a step's inputs (JSON values)."""
    return hashlib.sha256(json.dumps([RECIPE, *parts], sort_keys=True).encode()).hexdigest()[:16]


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return "sha256:" + hashlib.file_digest(f, "sha256").hexdigest()


@dataclass(frozen=True)
class Layer:
    """A layer blob in the cache."""

    digest: str  # sha256:... of the gzip blob
    diff_id: str  # sha256:... of the tar
    size: int
    comment: str


def blob_path(digest: str) -> Path:
    algorithm, _, hexdigest = digest.partition(":")
    return CACHE / "blobs" / algorithm / hexdigest


def new_blob_path() -> Path:
    """Where this process writes a blob before its digest names it."""
    return CACHE / "blobs" / f"tmp-{os.getpid()}"


def mounts_under(path: Path) -> list[str]:
    prefix = str(path.resolve())
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mountpoint = line.split()[4].replace("\\040", " ")
        if mountpoint == prefix or mountpoint.startswith(prefix + "/"):
            found.append(mountpoint)
    return found


def remove_tree(path: Path) -> None:
    """rm -rf, refused when anything is mounted below (never descend into a host mount)."""
    if not path.exists() and not path.is_symlink():
        return
    mounts = mounts_under(path)
    if mounts:
        raise ImageError(f"not removing {path}: mounts below it: {mounts}")
    shutil.rmtree(path)


def remove_other_keys(kept: Path) -> None:
    """Remove the siblings of `kept` (NAME-KEY) that are the same NAME under another key."""
    name = kept.name.rpartition("-")[0]
    for other in kept.parent.glob(f"{name}-*"):
        if other != kept and re.fullmatch(rf"{re.escape(name)}-[0-9a-f]{{16}}", other.name):
            remove_tree(other)


@dataclass
class Step:
    """A cached step: its rootfs tree (kept for the steps built on it) and its layers."""

    name: str
    key: str
    tree: Path | None
    layers: list[Layer]

    def rootfs(self) -> Path:
        """The kept tree, for a step built on this one."""
        if self.tree is None:
            raise ImageError(f"{self.name} kept no tree to build on")
        return self.tree


def _step_dir(name: str, key: str) -> Path:
    return CACHE / "steps" / f"{name}-{key}"


def _load_step(name: str, key: str, keep_tree: bool) -> Step | None:
    directory = _step_dir(name, key)
    record = directory / "layers.json"
    if not record.is_file():
        return None
    layers = [Layer(**layer) for layer in json.loads(record.read_text())]
    if not all(blob_path(layer.digest).is_file() for layer in layers):
        return None
    tree = directory / "rootfs"
    if keep_tree and not tree.is_dir():
        return None
    return Step(name, key, tree if keep_tree else None, layers)


def cached_step(
    name: str,
    key: str,
    build: Callable[[Path], list[Layer]],
    keep_tree: bool,
    log: Callable[[str], None],
) -> Step:
    """The step from the cache, else built by build(work dir with rootfs/ for the tree) and
    kept; other keys of the same step are removed."""
    step = _load_step(name, key, keep_tree)
    if step is not None:
        return step
    log(f"building {name} ({key})")
    started = time.monotonic()
    work = CACHE / "tmp" / f"{name}-{key}"
    remove_tree(work)
    work.mkdir(parents=True)
    try:
        layers = build(work)
        if not keep_tree:
            remove_tree(work / "rootfs")
        (work / "layers.json").write_text(json.dumps([asdict(layer) for layer in layers]))
        final = _step_dir(name, key)
        remove_tree(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        work.rename(final)
    finally:
        remove_tree(work)
    remove_other_keys(final)
    log(f"built {name} in {time.monotonic() - started:.0f} s")
    return Step(name, key, final / "rootfs" if keep_tree else None, layers)


def prune_blobs() -> None:
    """Drop the blobs no cached step refers to."""
    wanted: set[str] = set()
    for record in (CACHE / "steps").glob("*/layers.json"):
        wanted.update(layer["digest"] for layer in json.loads(record.read_text()))
    for blob in (CACHE / "blobs" / "sha256").glob("*"):
        if f"sha256:{blob.name}" not in wanted:
            blob.unlink()


@contextlib.contextmanager
def locked() -> Iterator[None]:
    """Hold the cache's lock: one build at a time."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
