"""Writing sysctls of the network namespace the calling thread is in."""

from __future__ import annotations

import os
from pathlib import Path

from cni.kernel.errors import SysctlError

# A container's /proc/sys is read-only unless it is privileged. knit's DaemonSet, which is not,
# mounts the node's /proc/sys/net writable at /host/proc/sys/net and names /host/proc/sys here.
# A file under net/ speaks for the network namespace of the thread that opens it, whatever path
# reaches the procfs, so that one mount serves the node and every pod's namespace.
ROOT_ENV = "KNIT_PROC_SYS"


def path(key: str) -> Path:
    """The file of sysctl key (slash-separated, net/ipv4/ip_forward: interface names may hold
    dots)."""
    return Path(os.environ.get(ROOT_ENV, "/proc/sys")) / key


def write(key: str, value: str) -> None:
    target = path(key)
    try:
        if target.read_text().strip() != value:
            target.write_text(value)
    except OSError as err:
        raise SysctlError(f"cannot set sysctl {key}={value}: {err}") from err


def interface_key(family: str, ifname: str, name: str) -> str:
    return f"net/{family}/conf/{ifname}/{name}"
