"""host-local's on-disk store, byte-compatible with the reference plugin's.

<dataDir>/<network>/<ip> holds "<containerID>\\r\\n<ifname>" (older files hold only the
container ID), last_reserved_ip.<set index> holds the last address handed out from that
range set, and every change happens under flock on <dataDir>/<network>/lock.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cni.errors import CniError, Code
from cni.paths import inside
from cni.result import IPAddress

LINE_BREAK = "\r\n"
LAST_RESERVED_PREFIX = "last_reserved_ip."
LOCK_FILE = "lock"


class _HeldLocks(threading.local):
    """The store directories whose lock this thread holds."""

    def __init__(self) -> None:
        self.directories: set[Path] = set()


_HELD = _HeldLocks()


def attachment_key(container_id: str, ifname: str) -> str:
    return container_id.strip() + LINE_BREAK + ifname


class Store:
    def __init__(self, data_dir: str, network: str) -> None:
        self.directory = inside(data_dir, network)

    @contextmanager
    def locked(self) -> Iterator[Store]:
        """The store under its lock; reentrant within a thread, so the daemon's start-up GC
        can scan and release under one hold (a second descriptor's flock would wait for this
        thread itself)."""
        if self.directory in _HELD.directories:
            yield self
            return
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:  # dataDir a file, read-only, full: no store to lock
            raise CniError(
                Code.IO_FAILURE, f"IPAM dataDir {self.directory} is unusable: {err}"
            ) from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            _HELD.directories.add(self.directory)
            try:
                yield self
            finally:
                _HELD.directories.discard(self.directory)
        finally:
            os.close(fd)

    def reserve(self, ip: IPAddress, container_id: str, ifname: str, range_set: int) -> bool:
        """Claim ip for the attachment; False when someone holds it already."""
        path = self.directory / str(ip)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        try:
            os.write(fd, attachment_key(container_id, ifname).encode())
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        (self.directory / f"{LAST_RESERVED_PREFIX}{range_set}").write_text(str(ip))
        return True

    def last_reserved(self, range_set: int) -> IPAddress | None:
        try:
            return ipaddress.ip_address(
                (self.directory / f"{LAST_RESERVED_PREFIX}{range_set}").read_text().strip()
            )
        except (FileNotFoundError, ValueError):
            return None

    def reservations(self) -> dict[IPAddress, tuple[str, str]]:
        """Every reserved address with its (container ID, ifname); ifname is "" in old files."""
        found: dict[IPAddress, tuple[str, str]] = {}
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return found
        for entry in entries:
            try:
                ip = ipaddress.ip_address(entry.name)
                content = Path(entry.path).read_bytes().decode().strip()
            except (ValueError, OSError):
                continue
            container_id, _, ifname = content.partition(LINE_BREAK)
            found[ip] = (container_id.strip(), ifname.strip())
        return found

    def owned_by(self, container_id: str, ifname: str) -> list[IPAddress]:
        """Addresses held by the attachment; old files match on the container ID alone."""
        cid = container_id.strip()
        return [
            ip
            for ip, (owner, owner_ifname) in self.reservations().items()
            if owner == cid and owner_ifname in (ifname, "")
        ]

    def released_by(self, container_id: str, ifname: str) -> list[IPAddress]:
        """What DEL gives back: the attachment's addresses, or when it has none, those of old
        files naming its container (the reference's ReleaseByID)."""
        cid = container_id.strip()
        reservations = self.reservations().items()
        current = [ip for ip, owner in reservations if owner == (cid, ifname)]
        return current or [ip for ip, owner in reservations if owner == (cid, "")]

    def release(self, ip: IPAddress) -> None:
        (self.directory / str(ip)).unlink(missing_ok=True)
