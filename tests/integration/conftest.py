from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kubernetes.client import ApiClient

from deploy.lab.controlplane import ControlPlane
from deploy.lab.kube import Kube
from deploy.lab.netns import Netns
from deploy.lab.paths import PLUGIN_DIR, ROOT
from tests.conftest import netns_factory
from tests.support.cni_env import Node
from tests.support.proxy_env import ProxyNode, running_proxy_node


@pytest.fixture(scope="session")
def cni_bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin's self-contained bundle, built once from this interpreter around the client
    `make cni` builds."""
    output = tmp_path_factory.mktemp("bundle") / "cni-bundle"
    client = PLUGIN_DIR / "knit"
    subprocess.run(
        [sys.executable, "-m", "cni.bundle", "--output", str(output), "--client", str(client)],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    return output


@pytest.fixture
def node(make_netns, tmp_path) -> Node:
    return Node(make_netns("node"), tmp_path / "ipam", make_netns)


@pytest.fixture(scope="module")
def module_netns() -> Iterator[Callable[[str], Netns]]:
    """Namespaces that live for a whole test module (a node shared by its tests)."""
    yield from netns_factory()


@pytest.fixture(scope="module")
def proxy_mode() -> str:
    """The datapath proxy_node runs; a module overrides it to run its tests in other modes."""
    return "iptables"


@pytest.fixture(scope="module")
def proxy_node(
    proxy_mode: str,
    control_plane: ControlPlane,
    kube_api: ApiClient,
    module_netns: Callable[[str], Netns],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ProxyNode]:
    """A node running knit-proxyd against the real API server, with an outside host."""
    kube = Kube(kube_api)
    try:
        with running_proxy_node(
            control_plane,
            kube,
            module_netns("node"),
            module_netns,
            tmp_path_factory.mktemp("proxy-node"),
            proxy_mode,
        ) as proxy:
            yield proxy
    finally:
        kube.cleanup()


@pytest.fixture
def kube(kube_api: ApiClient) -> Iterator[Kube]:
    objects = Kube(kube_api)
    yield objects
    objects.cleanup()
