"""Writing sysctls of the network namespace the calling thread is in."""

from __future__ import annotations

from pathlib import Path

from cni.errors import CniError, Code


def write(key: str, value: str) -> None:
    """key is slash-separated (net/ipv4/ip_forward): interface names may hold dots."""
    path = Path("/proc/sys") / key
    try:
        if path.read_text().strip() != value:
            path.write_text(value)
    except OSError as err:
        raise CniError(Code.IO_FAILURE, f"cannot set sysctl {key}={value}: {err}") from err


def interface_key(family: str, ifname: str, name: str) -> str:
    return f"net/{family}/conf/{ifname}/{name}"
