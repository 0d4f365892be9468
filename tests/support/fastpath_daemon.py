"""The fast path's daemon (cni.server) in a node namespace, and the plugin called through it."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from deploy.lab.netns import Netns
from deploy.lab.paths import PLUGIN_DIR, REFERENCE_PLUGINS, ROOT
from deploy.lab.process import eventually
from tests.support.cni_env import Node

SERVER = """
import logging, sys
logging.basicConfig(filename=sys.argv[2], level=logging.INFO, format="%(message)s")
from cni.ipam import delegate
from cni.server import serve
if sys.argv[4]:
    delegate.DEADLINE = float(sys.argv[4])
server = serve(sys.argv[1], bin_dirs=sys.argv[3].split(":"))
print("ready", flush=True)
sys.stdin.read()
server.close()
"""


def build_launcher(directory: Path, socket_path: Path | None) -> Path:
    """The Makefile's `knit` in directory/cni, its launch file naming socket_path."""
    named = f"CNI_SOCKET={socket_path}" if socket_path else "CNI_SOCKET="
    target = directory / "cni" / "knit"
    launch = directory / "cni" / "knit.d" / "launch"
    make = ["make", "-s", "-C", str(ROOT), "-o", "venv", f"BUILD={directory}", named]
    subprocess.run(
        [*make, str(target), str(launch)],
        check=True,
        capture_output=True,
    )
    return target


@dataclass
class Daemon:
    socket_path: Path
    log: Path
    proc: subprocess.Popen[str]

    def served(self) -> list[str]:
        """The verbs the daemon has served, in order, from its log."""
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        calls = [line for line in lines if line.startswith("CNI ")]
        return [line.split()[1] for line in calls if not line.startswith("CNI server:")]

    def wait_served(self, verbs: list[str]) -> None:
        """Wait (5 s at most, else TimeoutError) until the log lists exactly these verbs in
        some order: the daemon logs a call after answering it, so its line may trail."""
        wanted = sorted(verbs)
        eventually(lambda: sorted(self.served()) == wanted, 5, f"the daemon's log lists {wanted}")

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# The daemon's own variables, which no call may see (see the delegation tests).
DAEMON_ENV = {"CNI_CONTAINERID": "the-daemons-own", "KNIT_DAEMON_TOKEN": "the-daemons-own"}


@contextmanager
def running_daemon(
    node: Node,
    directory: Path,
    through: Sequence[str] = (),
    bin_dirs: Sequence[Path] = (PLUGIN_DIR, REFERENCE_PLUGINS),
    delegate_deadline: float | None = None,
) -> Iterator[Daemon]:
    """cni.server inside the node namespace, started through a command prefix if given,
    running delegated plugins from bin_dirs only (by default, raw_call's CNI_PATH)."""
    directory.mkdir(exist_ok=True)
    socket_path, log = directory / "run" / "cni.sock", directory / "daemon.log"
    deadline = "" if delegate_deadline is None else str(delegate_deadline)
    search = ":".join(map(str, bin_dirs))
    server = [sys.executable, "-c", SERVER, str(socket_path), str(log), search, deadline]
    proc = subprocess.Popen(
        ["ip", "netns", "exec", node.ns.name, *through, *server],
        cwd=ROOT,
        env={**os.environ, **DAEMON_ENV},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    served = Daemon(socket_path, log, proc)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        yield served
    finally:
        if proc.poll() is None:
            served.stop()


def in_own_mount_namespace(mount: str, *args: str) -> list[str]:
    """A command prefix: the command after it runs in a mount namespace of its own, once
    `mount` (a shell command, given args as $1...) has run there."""
    script = f'{mount} && shift {len(args)} && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *args]


@dataclass(frozen=True)
class HiddenNetns:
    """A pod's namespace bind-mounted at path for the runtime alone (as /proc/<pid>/ns/net or
    a runtime's private bind mount): the daemon started through `hide` cannot see it."""

    path: Path
    hide: list[str]
    runtime: list[str]


def hidden_netns(directory: Path, pod: Netns) -> HiddenNetns:
    """The command prefixes for the daemon and the runtime's calls, and the path they name."""
    hidden = directory / "hidden"
    hidden.mkdir()
    path = hidden / "pod-netns"
    path.touch()
    return HiddenNetns(
        path,
        hide=in_own_mount_namespace('mount -t tmpfs knit-test "$1"', str(hidden)),
        runtime=in_own_mount_namespace('mount --bind "$1" "$2"', pod.path, str(path)),
    )


def raw_call(
    node: Node,
    launcher: Path,
    command: str,
    stdin: bytes,
    through: Sequence[str] = (),
    **env: str,
) -> tuple[int, bytes]:
    full_env = {
        "PATH": os.environ["PATH"],
        "CNI_COMMAND": command,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": f"{PLUGIN_DIR}:{REFERENCE_PLUGINS}",
        **env,
    }
    done = node.ns.run(*through, str(launcher), stdin=stdin, env=full_env, check=False)
    return done.returncode, done.stdout
