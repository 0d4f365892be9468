"""The rootfs steps: Debian's minbase from debootstrap, and a tree with more apt packages, each
a cached step whose layer is the tree's changes, and commands run in a tree with chroot.

The base is Debian bookworm (variant minbase), brought up to date from bookworm-updates and
bookworm-security; every image built on a Debian rootfs shares its layer. Chroot commands run
inside `unshare --mount --propagation private`, so the proc and tmpfs mounts they make (and the
ones debootstrap makes) die with them. apt fetches with the host's resolver and starts no
services, and leaves no lists or caches in the tree. The base is keyed on the recipe, not on
the day: remove build/images/cache/ for fresh packages.
"""

from __future__ import annotations

import contextlib
import platform
import shlex
import shutil
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from deploy.lab.image.cache import Layer, Step, cached_step, key, remove_tree
from deploy.lab.image.errors import ImageError
from deploy.lab.image.layers import write_layer

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
SOURCES = (
    f"deb {MIRROR} {SUITE} main\n"
    f"deb {MIRROR} {SUITE}-updates main\n"
    f"deb http://deb.debian.org/debian-security {SUITE}-security main\n"
)
# The environment a Debian image starts with (debian:bookworm's PATH). The Dockerfile's base,
# python:3.11-slim, has its own Python in /usr/local (PATH=/usr/local/bin:... and LANG=C.UTF-8
# for it); here Python is Debian's python3 in /usr/bin, so the final PATH lacks that extra
# /usr/local/bin. LANG=C.UTF-8 is kept as the python image sets it.
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG": "C.UTF-8",
}
# a mount namespace of the command's own: its mounts go when it exits
PRIVATE_MOUNTS = ("unshare", "--mount", "--propagation", "private")
CHROOT = (
    'set -e; root=$1; shift; mkdir -p "$root/proc" "$root/dev/shm"; '
    'mount -t proc proc "$root/proc"; mount -t tmpfs -o mode=1777 shm "$root/dev/shm"; '
    'exec chroot "$root" "$@"'
)


def run(argv: Sequence[str | Path], env: dict[str, str] | None = None) -> str:
    """Run argv; returns its output, or raises with the end of it."""
    args = [str(a) for a in argv]
    result = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-30:])
        raise ImageError(f"{shlex.join(args)} failed ({result.returncode}):\n{tail}")
    return result.stdout


def chroot(root: Path, *argv: str, env: dict[str, str] | None = None) -> str:
    """Run argv inside the rootfs (with /proc and /dev/shm) in a private mount namespace;
    returns its output."""
    environment = {**BASE_ENV, "HOME": "/root", "DEBIAN_FRONTEND": "noninteractive", **(env or {})}
    return run([*PRIVATE_MOUNTS, "sh", "-c", CHROOT, "sh", root, *argv], env=environment)


def copy_tree(source: Path, target: Path) -> None:
    run(["cp", "-a", "--reflink=auto", source, target])


@contextlib.contextmanager
def _apt(root: Path) -> Iterator[None]:
    """apt can fetch (the host's resolver) and no package starts a service; both undone."""
    policy = root / "usr/sbin/policy-rc.d"
    resolv = root / "etc/resolv.conf"
    policy.write_text("#!/bin/sh\nexit 101\n")
    policy.chmod(0o755)
    resolv.unlink(missing_ok=True)
    shutil.copyfile("/etc/resolv.conf", resolv)
    try:
        yield
        chroot(root, "apt-get", "clean")
    finally:
        policy.unlink(missing_ok=True)
        resolv.unlink(missing_ok=True)
        lists = root / "var/lib/apt/lists"
        for entry in lists.iterdir() if lists.is_dir() else ():
            if entry.is_file() and entry.name != "lock":
                entry.unlink()
        remove_tree(lists / "partial")
        (lists / "partial").mkdir(mode=0o700)
        for cache in (root / "var/cache/apt").glob("*.bin"):
            cache.unlink()


def base_step(log: Callable[[str], None]) -> Step:
    """Debian minbase from debootstrap, upgraded from -updates and -security."""

    def build(work: Path) -> list[Layer]:
        rootfs = work / "rootfs"
        run([*PRIVATE_MOUNTS, "debootstrap", "--variant=minbase", SUITE, rootfs, MIRROR])
        (rootfs / "etc/apt/sources.list").write_text(SOURCES)
        (rootfs / "etc/hostname").unlink(missing_ok=True)  # debootstrap copies the host's
        (rootfs / "var/log/bootstrap.log").unlink(missing_ok=True)
        (rootfs / "dev/shm").mkdir(exist_ok=True)
        with _apt(rootfs):
            chroot(rootfs, "apt-get", "update", "-q")
            chroot(rootfs, "apt-get", "dist-upgrade", "-y", "-q")
        return [write_layer(f"debootstrap --variant=minbase {SUITE}", rootfs)]

    base_key = key("base", SUITE, MIRROR, SOURCES, platform.machine())
    return cached_step("base", base_key, build, keep_tree=True, log=log)


def packages_step(
    name: str, parent: Step, packages: Sequence[str], log: Callable[[str], None]
) -> Step:
    """The parent's tree with `apt-get install --no-install-recommends packages`."""
    lower = parent.rootfs()

    def build(work: Path) -> list[Layer]:
        rootfs = work / "rootfs"
        copy_tree(lower, rootfs)
        with _apt(rootfs):
            chroot(rootfs, "apt-get", "update", "-q")
            chroot(rootfs, "apt-get", "install", "-y", "-q", "--no-install-recommends", *packages)
        return [
            *parent.layers,
            write_layer(f"apt-get install {' '.join(packages)}", rootfs, lower),
        ]

    step_key = key(name, parent.key, list(packages))
    return cached_step(name, step_key, build, keep_tree=True, log=log)
