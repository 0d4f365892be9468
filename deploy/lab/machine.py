"""A lab node's machine: its own network namespace, mount namespace and cgroups.

A real node keeps /etc/cni/net.d, /opt/cni/bin, /var/lib/{cni,kubelet,containerd}, /var/log/pods
and /run on its own disk; containerd, kubelet and the pods' hostPath volumes name those paths.
Here each node gets a mount namespace, held open by one `sleep` process, in which

- /etc and /opt are overlays of the host's with the node's folder as the upper layer, so the
  node sees the host's files and everything it writes lands in FOLDER/etc and FOLDER/opt;
- /var/lib, /var/log and /run are the node's own folders (FOLDER/var/lib, ...), not the host's;
- /sys is a sysfs of the node's network namespace, with the host's cgroup hierarchies in it;
- every mount is shared among the node's own mount namespaces, as on a node booted by systemd.

The namespace is private: nothing mounted in it reaches the host, and all of it goes when its
last process ends. Every process of the node (the holder, containerd, kubelet, and through
kubelet's cgroupRoot every pod) lives under one cgroup in every hierarchy, so stopping the
node is killing that cgroup's processes and removing it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path

from deploy.lab.process import detach, sh

HOLD = r"""
set -eu
F=$NODE_FOLDER
mkdir -p "$F/.cgroup"
# the node's sysfs shows its own links; the host's cgroup mounts are moved into it
mount --rbind /sys/fs/cgroup "$F/.cgroup"
mount -t sysfs sysfs /sys
mount --move "$F/.cgroup" /sys/fs/cgroup
rmdir "$F/.cgroup"
for d in etc opt; do
    mkdir -p "$F/$d" "$F/.overlay/$d"
    mount -t overlay overlay -o "lowerdir=/$d,upperdir=$F/$d,workdir=$F/.overlay/$d" "/$d"
done
for d in var/lib var/log run; do
    mkdir -p "$F/$d"
    mount --bind "$F/$d" "/$d"
done
# shared within the node, as systemd makes a real node's /: a pod's HostToContainer volume
# needs it (the namespace's peers are all its own; the host is no peer of it)
mount --make-rshared /
exec sleep infinity
"""


def hierarchies() -> list[Path]:
    """The mounted cgroup hierarchies: every v1 one, name=systemd included, which kubelet on
    cgroup v1 needs its cgroupRoot in, and the unified one of a hybrid host, where runc and
    kubelet make their cgroups too."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        if fields[separator + 1] in ("cgroup", "cgroup2"):
            found.append(Path(fields[4]))
    return sorted(found)


class Cgroup:
    """One cgroup path made in every hierarchy (cpuset's cpus and mems copied down, which a
    new cpuset cgroup lacks and without which no process may join it)."""

    def __init__(self, path: str) -> None:
        self.path = path.strip("/")

    def dirs(self) -> list[Path]:
        return [hierarchy / self.path for hierarchy in hierarchies()]

    def create(self) -> None:
        for hierarchy in hierarchies():
            current = hierarchy
            for part in Path(self.path).parts:
                parent, current = current, current / part
                current.mkdir(exist_ok=True)
                if (current / "cpuset.cpus").exists():
                    for name in ("cpuset.cpus", "cpuset.mems"):
                        if not (current / name).read_text().strip():
                            (current / name).write_text((parent / name).read_text())

    def pids(self) -> set[int]:
        """Every process in the cgroup or below it, in any hierarchy. Cgroups below may go
        while this looks (runc removes a killed container's): os.walk passes over a folder
        that is gone, where Path.rglob raised."""
        found: set[int] = set()
        for directory in self.dirs():
            for below, _, files in os.walk(directory):
                if "cgroup.procs" in files:
                    with contextlib.suppress(OSError):
                        text = (Path(below) / "cgroup.procs").read_text()
                        found.update(int(pid) for pid in text.split())
        return found

    def kill(self, timeout: float = 30.0) -> None:
        """SIGKILL every process in the cgroup until none is left (a dying process may fork no
        more, but one forked before the signal still arrives)."""
        deadline = time.monotonic() + timeout
        while pids := self.pids():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {self.path}: processes {sorted(pids)} outlive SIGKILL")
            time.sleep(0.05)

    def remove(self) -> None:
        """The cgroup and every cgroup below it, deepest first (they must be empty)."""
        for directory in self.dirs():
            if not directory.is_dir():
                continue
            for below, _, _ in sorted(os.walk(directory), key=lambda w: -len(w[0])):
                with contextlib.suppress(FileNotFoundError):
                    os.rmdir(below)


class Machine:
    """A node's namespaces and cgroup, and the processes started in them."""

    def __init__(self, netns: str, folder: Path, cgroup: str) -> None:
        self.netns = netns
        self.folder = folder
        self.cgroup = Cgroup(cgroup)
        self.holder = 0

    def boot(self) -> None:
        """Make the cgroup and the mount namespace (held by a process in the node's cgroup)."""
        self.cgroup.create()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.holder = self.spawn(
            [
                "nsenter", f"--net=/run/netns/{self.netns}", "--",
                "unshare", "--mount", "--propagation", "private", "--",
                "sh", "-c", HOLD,
            ],
            self.folder / "machine.log",
            env={"NODE_FOLDER": str(self.folder)},
            enter=False,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while not self._held():
            if time.monotonic() > deadline:
                log = (self.folder / "machine.log").read_text()
                raise RuntimeError(f"{self.netns}: mount namespace not ready: {log}")
            time.sleep(0.02)

    def power_off(self) -> None:
        """The machine stopped as by a power cut: every process in its cgroup killed, none
        told (the holder's end takes the mount namespace and every mount in it along), its
        cgroups removed and its /run, a tmpfs on a real machine, emptied. The rest of its
        folder, its disk, stays; its network namespace is its owner's to remove."""
        self.cgroup.kill()
        self.cgroup.remove()
        shutil.rmtree(self.folder / "run")

    def _held(self) -> bool:
        try:
            exe = os.readlink(f"/proc/{self.holder}/exe")
        except OSError as err:
            raise RuntimeError(f"{self.netns}: the mount namespace's holder ended") from err
        return exe.endswith("/sleep")

    def spawn(
        self,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        enter: bool = True,
    ) -> int:
        """Start argv in the node's namespaces and cgroup, in a session of its own, writing to
        log; returns its pid (the process outlives this one)."""
        if enter:
            argv = ["nsenter", f"--target={self.holder}", "--mount", "--net", "--", *argv]
        joins = [directory / "cgroup.procs" for directory in self.cgroup.dirs()]

        def join() -> None:
            for procs in joins:
                procs.write_text(str(os.getpid()))

        return detach(argv, log, env, join)

    def run(self, *argv: str, timeout: float = 60) -> str:
        """Run argv in the node's namespaces and return its output (RuntimeError if it fails)."""
        return sh(
            "nsenter", f"--target={self.holder}", "--mount", "--net", "--", *argv, timeout=timeout
        )
