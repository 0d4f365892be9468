"""Network namespaces for tests, benches and the lab: unique names, a handle that runs
commands and traffic inside one, and removal that also ends what still runs there."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

from cni.kernel import netns as cni_netns

ECHO = Path(__file__).resolve().parent / "echo.py"
"""The server and clients every world's traffic goes through (see its docstring)."""
_names = itertools.count()


def unique_name(prefix: str) -> str:
    """prefix-PID-N: unique on this machine while this process lives."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def remove_namespace(name: str) -> None:
    """Kill what still runs in the namespace, then delete it (no error when it is gone)."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True)
    for pid in pids.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)


@dataclass
class Netns:
    name: str
    servers: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def path(self) -> str:
        return f"/var/run/netns/{self.name}"

    # text in and out, unless the input is bytes
    @overload
    def run(
        self,
        *argv: str,
        check: bool = True,
        stdin: str | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]: ...

    @overload
    def run(
        self,
        *argv: str,
        check: bool = True,
        stdin: bytes,
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[bytes]: ...

    def run(
        self,
        *argv: str,
        check: bool = True,
        stdin: str | bytes | None = None,
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[Any]:
        return subprocess.run(
            ["ip", "netns", "exec", self.name, *argv],
            input=stdin,
            env=env,
            capture_output=True,
            check=check,
            timeout=timeout,
            text=not isinstance(stdin, bytes),
        )

    @contextmanager
    def entered(self) -> Iterator[None]:
        """Run the block with this thread inside the namespace."""
        fd = cni_netns.open_netns(self.path)
        try:
            with cni_netns.entered(fd):
                yield
        finally:
            os.close(fd)

    def ip(self, *args: str) -> str:
        return self.run("ip", *args).stdout

    def serve(self, host: str, port: int, proto: str = "tcp", label: str = "") -> None:
        """echo.py serving on host:port; returns once it listens."""
        argv = [sys.executable, str(ECHO), "serve", host, str(port), proto]
        proc = subprocess.Popen(
            ["ip", "netns", "exec", self.name, *argv, *([label] if label else [])],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        self.servers.append(proc)

    def exchange(
        self, host: str, port: int, proto: str = "tcp", source_port: int = 0
    ) -> tuple[str, str]:
        """(client address as the server saw it, server address); raises when no answer came."""
        argv = [sys.executable, str(ECHO), "request", host, str(port), proto, str(source_port)]
        client, server = self.run(*argv, timeout=10).stdout.split()
        return client, server

    def request(self, host: str, port: int, proto: str = "tcp") -> str:
        """The address the server saw us come from; raises when no answer came."""
        return self.exchange(host, port, proto)[0]

    def reaches(self, host: str, port: int, proto: str = "tcp") -> bool:
        argv = [sys.executable, str(ECHO), "request", host, str(port), proto]
        return self.run(*argv, check=False, timeout=10).returncode == 0

    def remove(self) -> None:
        for proc in self.servers:
            proc.kill()
            proc.wait()
        remove_namespace(self.name)


@contextmanager
def namespaces(prefix: str = "") -> Iterator[Callable[[str], Netns]]:
    """A maker of namespaces (unique names under `prefix`, lo up), all removed when the block
    ends, however it ends."""
    created: list[Netns] = []

    def make(name: str = "knit") -> Netns:
        ns = Netns(unique_name(f"{prefix}{name}"))
        subprocess.run(["ip", "netns", "add", ns.name], check=True)
        created.append(ns)
        ns.run("ip", "link", "set", "lo", "up")
        return ns

    try:
        yield make
    finally:
        for ns in reversed(created):
            ns.remove()
