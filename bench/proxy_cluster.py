"""The cluster the proxy bench runs against: one node, and Services with their EndpointSlices,
made in the API server at the start and changed during the run."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client, config

from bench.proxy_daemon import METRICS_ADDRESS, TRIGGER_TIME, Daemon
from deploy.lab.controlplane import ControlPlane, start
from deploy.lab.kube import SERVICES, SLICES, Kube, endpoint, service_object, slice_object
from deploy.lab.netns import Netns
from deploy.lab.proxyd_node import NodeFiles, proxyd_flags

NODE = "bench-node"
NODE_ADDRESS = "198.18.0.1"
REMOTE_NODE = "node-elsewhere"
"""The node every service's endpoints are on: not this one, so no rule is local."""
CLUSTER_CIDR = "10.244.0.0/16"
PORT, TARGET_PORT = 80, 8080
ENDPOINTS = 10
SLICE_PORTS = [{"name": "", "port": TARGET_PORT, "protocol": "TCP"}]
WORKERS = 16
CHURN_CHANGES = 1000
CHURN_SERVICES = 100


def service_name(index: int) -> str:
    return f"svc-{index:05d}"


def fake_endpoints(index: int) -> list[dict[str, Any]]:
    """Pod IPs in 10.244.0.0-10.244.99.255, away from the client and the backend."""
    hosts = ((index * ENDPOINTS + j) % 25000 for j in range(ENDPOINTS))
    return [endpoint(f"10.244.{h // 250}.{h % 250 + 1}", REMOTE_NODE) for h in hosts]


def bench_api(stack: ExitStack, work: Path) -> tuple[ControlPlane, client.ApiClient, Kube]:
    """The real control plane in `work`, an API client of it and a Kube over that client,
    all stopped and closed by `stack`."""
    plane = start(work / "controlplane")
    stack.callback(plane.stop)
    api = api_client(plane)
    stack.callback(api.close)
    return plane, api, Kube(api)


def api_client(plane: ControlPlane) -> client.ApiClient:
    configuration = client.Configuration()
    config.load_kube_config(str(plane.kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = WORKERS
    return client.ApiClient(configuration)


def create_services(kube: Kube, indices: range) -> float:
    """Seconds to create a Service and its EndpointSlice for each index, in parallel."""

    def one(index: int) -> None:
        name = service_name(index)
        ports = [{"port": PORT, "targetPort": TARGET_PORT, "protocol": "TCP"}]
        kube.call("POST", SERVICES, service_object(name, ports))
        kube.call("POST", SLICES, slice_object(name, fake_endpoints(index), SLICE_PORTS))

    began = time.monotonic()
    pool = ThreadPoolExecutor(WORKERS)
    try:
        list(pool.map(one, indices))
    finally:
        pool.shutdown(cancel_futures=True)
    return time.monotonic() - began


class SliceChange:
    """One service's EndpointSlice, changed in the API one endpoint at a time."""

    def __init__(self, kube: Kube, name: str) -> None:
        self.kube = kube
        self.name = name
        self.endpoints = kube.call("GET", f"{SLICES}/{name}-ipv4")["endpoints"]
        self.changes = 0

    def apply(self, new_ip: str) -> None:
        """Replace the endpoint changed longest ago by new_ip, stamping the slice with the time
        of the change as the EndpointSlice controller stamps its own."""
        self.endpoints[self.changes % len(self.endpoints)] = endpoint(new_ip, REMOTE_NODE)
        self.changes += 1
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        patch = {"metadata": {"annotations": {TRIGGER_TIME: stamp}}, "endpoints": self.endpoints}
        self.kube.patch(f"{SLICES}/{self.name}-ipv4", patch)


def start_knit(
    node: Netns, kubeconfig: Path, folder: Path, mode: str, log: Path, profile: Path | None
) -> Daemon:
    """knit-proxyd on the bench's node in `mode`, its CNI files under folder, its metrics on
    METRICS_ADDRESS."""
    (folder / "networks").mkdir(parents=True, exist_ok=True)
    files = NodeFiles(folder / "net.d", folder / "bin", folder / "networks")
    flags = proxyd_flags(
        kubeconfig, NODE, CLUSTER_CIDR, files, "--metrics-bind-address", METRICS_ADDRESS,
        mode=mode,
    )  # fmt: skip
    return Daemon.knit(node, flags, log, profile)
