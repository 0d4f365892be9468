"""Shared fixtures: namespaces created per test and always removed, the built plugin, traffic,
and one real control plane (etcd + kube-apiserver on host loopback) for the whole session."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import ApiClient
from kubernetes.config import new_client_from_config

from deploy.lab.controlplane import ControlPlane, ControlPlaneError, attached, start
from deploy.lab.netns import Netns, namespaces
from deploy.lab.paths import CONTROLPLANE_BIN, PLUGIN_DIR, REFERENCE_PLUGINS
from proxyd import kubeapi


def netns_factory() -> Iterator[Callable[[str], Netns]]:
    """deploy.lab.netns.namespaces, skipped without root."""
    if os.geteuid() != 0:
        pytest.skip("network namespace tests need root")
    with namespaces() as make:
        yield make


@pytest.fixture
def make_netns() -> Iterator[Callable[[str], Netns]]:
    yield from netns_factory()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ControlPlane]:
    """etcd + kube-apiserver from build/controlplane: started once, removed at the end; or,
    with KNIT_CONTROL_PLANE=STATE_DIR, one already running (`make controlplane`'s, or the
    host's for tests run inside a VM node), left running."""
    if existing := os.environ.get("KNIT_CONTROL_PLANE"):
        yield attached(Path(existing))
        return
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


@pytest.fixture(scope="session")
def proxy_api(control_plane: ControlPlane) -> kubeapi.Api:
    """knit-proxyd's own client (proxyd.kubeapi) for the session's control plane, made from the
    same kubeconfig as kube_api."""
    return kubeapi.from_kubeconfig([control_plane.kubeconfig])


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
        "CNI_PATH": f"{PLUGIN_DIR}:{REFERENCE_PLUGINS}",
    }
    full_env.update(env or {})
    stdin = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    result = node.run(str(plugin), stdin=stdin, env=full_env, check=False)
    out = result.stdout.decode().strip()
    return CniAnswer(result.returncode, json.loads(out) if out else None, result.stderr.decode())
