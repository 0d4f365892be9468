"""Shared fixtures: namespaces created per test and always removed, the built plugin, traffic,
and one real control plane (etcd + kube-apiserver on host loopback) for the whole session."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import ApiClient
from kubernetes.config import new_client_from_config

from cni import netns as cni_netns
from deploy.lab.controlplane import ControlPlane, ControlPlaneError, start

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "build"
PLUGIN_DIR = BUILD / "cni"
REFERENCE_DIR = BUILD / "refcni"
CNIDRIVER = BUILD / "tools" / "cnidriver"
CONTROLPLANE_BIN = BUILD / "controlplane"
ECHO = Path(__file__).resolve().parent / "echo.py"
_names = itertools.count()


def unique_name(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_names)}"


@dataclass
class Netns:
    name: str
    servers: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def path(self) -> str:
        return f"/var/run/netns/{self.name}"

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
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                self.name,
                sys.executable,
                str(ECHO),
                "serve",
                host,
                str(port),
                proto,
                *([label] if label else []),
            ],
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
        result = self.run(
            sys.executable, str(ECHO), "request", host, str(port), proto, check=False, timeout=10
        )
        return result.returncode == 0

    def remove(self) -> None:
        for proc in self.servers:
            proc.kill()
            proc.wait()
        pids = subprocess.run(
            ["ip", "netns", "pids", self.name], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            subprocess.run(["kill", "-9", pid], check=False)
        subprocess.run(["ip", "netns", "del", self.name], check=False)


def netns_factory() -> Iterator[Callable[[str], Netns]]:
    """Makes namespaces (unique names, lo up) and removes them all when closed."""
    if os.geteuid() != 0:
        pytest.skip("network namespace tests need root")
    created: list[Netns] = []

    def make(prefix: str = "knit") -> Netns:
        ns = Netns(unique_name(prefix))
        subprocess.run(["ip", "netns", "add", ns.name], check=True)
        created.append(ns)
        ns.run("ip", "link", "set", "lo", "up")
        return ns

    try:
        yield make
    finally:
        for ns in reversed(created):
            ns.remove()


@pytest.fixture
def make_netns() -> Iterator[Callable[[str], Netns]]:
    yield from netns_factory()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver from build/controlplane: started once, removed at the end."""
    state_dir = tmp_path_factory.mktemp("controlplane")
    try:
        plane = start(state_dir, bin_dir=CONTROLPLANE_BIN)
    except ControlPlaneError as err:
        shutil.rmtree(state_dir)
        pytest.fail(f"the control plane did not start: {err}", pytrace=False)
    try:
        yield plane
    finally:
        plane.stop()
        shutil.rmtree(state_dir)


@pytest.fixture(scope="session")
def kube_api(control_plane: ControlPlane) -> Iterator[ApiClient]:
    """A kubernetes client (system:masters) for the session's control plane."""
    api = new_client_from_config(config_file=str(control_plane.kubeconfig))
    yield api
    api.close()


@dataclass
class CniAnswer:
    code: int
    output: dict[str, Any] | None
    stderr: str

    @property
    def error_code(self) -> int | None:
        return self.output.get("code") if self.output and self.code else None


def call_plugin(
    node: Netns,
    command: str,
    conf: dict[str, Any] | bytes,
    *,
    container_id: str = "",
    netns: str = "",
    ifname: str = "eth0",
    args: str = "",
    env: dict[str, str] | None = None,
    plugin: Path = PLUGIN_DIR / "knit",
) -> CniAnswer:
    """Call the plugin as a runtime does: env variables, config on stdin, inside the node."""
    full_env = {
        "PATH": os.environ["PATH"],
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container_id,
        "CNI_NETNS": netns,
        "CNI_IFNAME": ifname,
        "CNI_ARGS": args,
        "CNI_PATH": f"{PLUGIN_DIR}:{REFERENCE_DIR}",
    }
    full_env.update(env or {})
    stdin = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    result = node.run(str(plugin), stdin=stdin, env=full_env, check=False)
    out = result.stdout.decode().strip()
    return CniAnswer(result.returncode, json.loads(out) if out else None, result.stderr.decode())
