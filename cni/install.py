"""Install the plugin from a bundle (cni.bundle) into a CNI bin directory, e.g. /opt/cni/bin.

    bin_dir/knit                  the bundle's compiled client (replaced by rename)
    bin_dir/knit.d/launch         its settings: the version's in-process plugin and the daemon's
                                  socket (replaced by rename; the format is in cni/client.c)
    bin_dir/knit.d/<version>/     the bundle's runtime, one directory per version, never changed
                                  once in place
    bin_dir/<plugin>              each of the bundle's plugins/ (replaced by rename)

A version directory is copied under a temporary name and renamed when complete, so a
half-copied version is never used; the launch file names it only once its plugin has answered
VERSION here. The client finds knit.d beside itself (argv[0]), so the same files work when the
daemon sees the host's bin directory under another path. Upgrades under running pods: a call
that started on the old version keeps its files, because install keeps the version the
previous launch file named and prunes only older ones; a DEL for a pod the old version created
runs on the new one, which reads no state the old one kept.

    python -m cni.install --bundle DIR --bin-dir DIR [--socket PATH]
"""

from __future__ import annotations

import argparse
import fcntl
import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from cni.bundle import CLIENT, ENTRY, IN_PROCESS, MANIFEST, PLUGINS, read_manifest

LAUNCHER = "knit"
VERSIONS = "knit.d"
LAUNCH = "launch"
TEMP_PREFIX = ".knit-tmp-"
VERSION_NAME = re.compile(r"^[0-9a-f]{16}$")
LAUNCH_VERSION = re.compile(rf"^plugin={re.escape(VERSIONS)}/([0-9a-f]{{16}})/", re.M)
# sockaddr_un's sun_path holds 108 bytes with the terminating NUL
MAX_SOCKET_PATH = 107


class InstallError(Exception):
    pass


def launch_text(version: str, socket_path: str | None) -> str:
    return f"plugin={VERSIONS}/{version}/{IN_PROCESS}\nsocket={socket_path or ''}\n"


def install(bundle: Path, bin_dir: Path, socket_path: str | None) -> Path:
    """Install the bundle; returns its version directory. Idempotent; concurrent installs into
    one directory take turns."""
    manifest = read_manifest(bundle)
    version: str = manifest["version"]
    if not VERSION_NAME.match(version) or manifest.get("client") != CLIENT:
        raise InstallError(f"{bundle / MANIFEST} is not a knit bundle's manifest")
    if socket_path and len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
        raise InstallError(f"the socket path {socket_path} is over {MAX_SOCKET_PATH} bytes")
    versions = bin_dir / VERSIONS
    versions.mkdir(parents=True, exist_ok=True)
    with _locked(versions / ".lock"):
        previous = installed_version(bin_dir)
        target = versions / version
        if not _complete(target, version):
            _copy_version(bundle, target)
        for plugin in sorted((bundle / PLUGINS).glob("*")):
            destination = bin_dir / plugin.name
            if not destination.is_file() or not filecmp.cmp(plugin, destination, shallow=False):
                _write_atomically(destination, plugin.read_bytes(), 0o755)
        launch = launch_text(version, socket_path).encode()
        if _read(versions / LAUNCH) != launch:
            _answers_version(target / IN_PROCESS)
            _write_atomically(versions / LAUNCH, launch, 0o644)
        client = (target / CLIENT).read_bytes()
        if _read(bin_dir / LAUNCHER) != client:
            _write_atomically(bin_dir / LAUNCHER, client, 0o755, check=_answers_version)
        _prune(bin_dir, keep={version, previous})
    return target


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def installed_version(bin_dir: Path) -> str | None:
    """The version the launch file in bin_dir names, if there is one."""
    try:
        match = LAUNCH_VERSION.search((bin_dir / VERSIONS / LAUNCH).read_text())
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return match[1] if match else None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _complete(target: Path, version: str) -> bool:
    try:
        return bool(read_manifest(target)["version"] == version and (target / ENTRY).is_file())
    except (FileNotFoundError, ValueError, KeyError):
        return False


def _copy_version(bundle: Path, target: Path) -> None:
    """Copy under a temporary name, flush, then rename into place (replacing a damaged copy)."""
    staging = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=target.parent))

    def ignore(directory: str, names: list[str]) -> set[str]:
        return {PLUGINS} & set(names) if Path(directory) == bundle else set()

    shutil.copytree(bundle, staging, dirs_exist_ok=True, ignore=ignore)
    staging.chmod(0o755)
    os.sync()
    if target.exists():
        target.rename(Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=target.parent)) / "damaged")
    staging.rename(target)
    _sync_directory(target.parent)


def _write_atomically(
    destination: Path, data: bytes, mode: int, check: Callable[[Path], None] | None = None
) -> None:
    """Write a temporary file beside the destination, check it, then rename it over."""
    fd, name = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=destination.parent)
    try:
        with os.fdopen(fd, "wb") as tmp:
            tmp.write(data)
            tmp.flush()
            os.fchmod(tmp.fileno(), mode)
            os.fsync(tmp.fileno())
        if check is not None:
            check(Path(name))
        os.replace(name, destination)
    except BaseException:
        os.unlink(name)
        raise
    _sync_directory(destination.parent)


def _answers_version(launcher: Path) -> None:
    """Refuse a plugin or client that cannot answer VERSION here (a damaged copy, a bundle
    built for another machine): the one in place keeps serving."""
    try:
        result = subprocess.run(
            [str(launcher)],
            env={"CNI_COMMAND": "VERSION"},
            input=b"",
            capture_output=True,
            timeout=30,
            check=False,
        )
        answer = json.loads(result.stdout) if result.returncode == 0 else {}
    except (OSError, subprocess.TimeoutExpired, ValueError) as err:
        raise InstallError(f"the new plugin does not run: {err}") from err
    if "supportedVersions" not in answer:
        raise InstallError(
            f"the new plugin does not answer VERSION (exit {result.returncode}): "
            f"{(result.stdout + result.stderr).decode(errors='replace').strip()}"
        )


def _sync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(bin_dir: Path, keep: set[str | None]) -> None:
    """Remove every version but the kept ones, and whatever an interrupted install left."""
    for entry in [*bin_dir.glob(TEMP_PREFIX + "*"), *(bin_dir / VERSIONS).iterdir()]:
        if entry.name.startswith(TEMP_PREFIX) and not entry.is_dir():
            entry.unlink()
        elif entry.name.startswith(TEMP_PREFIX) or (
            VERSION_NAME.match(entry.name) and entry.name not in keep
        ):
            shutil.rmtree(entry)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m cni.install", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--bundle", type=Path, required=True, help="a tree built by cni.bundle")
    parser.add_argument("--bin-dir", type=Path, required=True, help="the CNI bin directory")
    parser.add_argument("--socket", help="the node daemon's unix socket for the fast path")
    args = parser.parse_args(argv)
    try:
        print(install(args.bundle, args.bin_dir, args.socket))
    except (InstallError, OSError, ValueError, KeyError) as err:
        sys.exit(f"cni.install: cannot install {args.bundle} into {args.bin_dir}: {err}")


if __name__ == "__main__":
    main()
