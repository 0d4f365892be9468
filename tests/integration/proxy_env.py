"""A node namespace running knit-proxyd against the real control plane, pods attached to it
through the CNI plugin, an outside host, and the Kubernetes objects tests create."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kubernetes.client import ApiClient

from tests.conftest import ROOT, Netns
from tests.integration.cni_env import UPLINK_NODE, UPLINK_OUTSIDE, Node, Pod, bridge_conf

SERVICE_CIDRS = ("10.96.0.0/16", "fd00:10:96::/112")
EXTERNAL_NET = "203.0.113.0/24"
CLUSTER_CIDRS = "10.244.0.0/16,fd10:244::/32"
REMOTE_NODE = "node-elsewhere"
T = TypeVar("T")


def eventually(check: Callable[[], T], timeout: float = 15, interval: float = 0.2) -> T:
    """The first truthy result of check(); fails with the last error after timeout."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as err:
            last = err
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s (last error: {last!r})")
        time.sleep(interval)


class Kube:
    """The objects a test creates through the real client, deleted again at teardown."""

    def __init__(self, api: ApiClient) -> None:
        self.api = api
        self.created: list[str] = []

    def call(self, method: str, path: str, body: Any = None, content_type: str = "") -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        method, url, headers, body, _ = self.api.param_serialize(
            method=method,
            resource_path=path,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = self.api.call_api(method, url, header_params=headers, body=body)
        data = response.read()
        if response.status >= 300:
            raise RuntimeError(f"{method} {path}: HTTP {response.status} {data[:400]!r}")
        return json.loads(data) if data else None

    def create(self, collection: str, obj: dict[str, Any]) -> dict[str, Any]:
        created = self.call("POST", collection, obj)
        self.created.append(f"{collection}/{created['metadata']['name']}")
        return created

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        return self.call("PATCH", path, patch, "application/merge-patch+json")

    def delete(self, path: str) -> None:
        self.call("DELETE", path)
        if path in self.created:
            self.created.remove(path)

    def cleanup(self) -> None:
        for path in reversed(self.created):
            with contextlib.suppress(RuntimeError):
                self.call("DELETE", path)
        self.created.clear()


SERVICES = "/api/v1/namespaces/default/services"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"


def service_object(name: str, ports: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    labels = spec.pop("labels", {})
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "labels": labels},
        "spec": {"ports": ports, **spec},
    }


def endpoint(ip: str, node: str, **conditions: bool) -> dict[str, Any]:
    entry: dict[str, Any] = {"addresses": [ip], "nodeName": node}
    if conditions:
        entry["conditions"] = conditions
    return entry


def slice_object(
    service: str,
    endpoints: list[dict[str, Any]],
    ports: list[dict[str, Any]],
    *,
    name: str = "",
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name or f"{service}-{address_type.lower()}",
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": address_type,
        "ports": ports,
        "endpoints": endpoints,
    }


@dataclass
class ProxyNode:
    """The node under test: knit-proxyd running in `node.ns`."""

    node: Node
    outside: Netns
    name: str
    kubeconfig: Path
    log_path: Path
    conf: dict[str, Any]
    process: subprocess.Popen[bytes] | None = None
    args: list[str] = field(default_factory=list)
    forward: Any = None
    """The NetnsForward that lets the node reach the API server (stop it: API down)."""

    @property
    def ns(self) -> Netns:
        return self.node.ns

    def start(self, *extra: str) -> None:
        self.args = [
            "--kubeconfig",
            str(self.kubeconfig),
            "--hostname-override",
            self.name,
            "--cluster-cidr",
            CLUSTER_CIDRS,
            "--min-sync-period",
            "100ms",
            "--v",
            "4",
            *extra,
        ]
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            ["ip", "netns", "exec", self.ns.name, sys.executable, "-m", "proxyd", *self.args],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        eventually(lambda: self.metric("kubeproxy_sync_proxy_rules_last_timestamp_seconds") > 0)

    def stop(self) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
            self.process = None

    def restart(self, *extra: str) -> None:
        self.stop()
        self.start(*extra)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def http(self, url: str) -> tuple[int, str]:
        """(status, body) of a GET made inside the node."""
        code = (
            "import sys, urllib.request, urllib.error\n"
            "try:\n"
            f"    r = urllib.request.urlopen({url!r}, timeout=5)\n"
            "    print(r.status); print(r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.code); print(e.read().decode())\n"
        )
        out = self.ns.run(sys.executable, "-c", code).stdout
        status, _, body = out.partition("\n")
        return int(status), body.removesuffix("\n")

    def metric(self, name: str, labels: str = "") -> float:
        _, body = self.http("http://127.0.0.1:10249/metrics")
        prefix = f"{name}{{{labels}}} " if labels else f"{name} "
        for line in body.splitlines():
            if line.startswith(prefix):
                return float(line.split()[-1])
        return 0.0

    def synced_after(self, moment: float) -> bool:
        return self.metric("kubeproxy_sync_proxy_rules_last_timestamp_seconds") >= moment

    def iptables(self, table: str = "nat", family: int = 4) -> str:
        binary = "iptables-save" if family == 4 else "ip6tables-save"
        return self.ns.run(binary, "-t", table).stdout

    def add_pod(self, container_id: str, *ports: tuple[int, str]) -> Pod:
        """A pod answering with its container id on each (port, proto), IPv4 and IPv6."""
        pod = self.node.add_pod(self.conf, container_id)
        for port, proto in ports:
            pod.ns.serve("::", port, proto, container_id)
        return pod


def setup_node(
    node: Node, outside: Netns, name: str, kubeconfig: Path, log_path: Path
) -> ProxyNode:
    node.connect_outside(outside)
    node.ns.run("ip", "route", "add", "default", "via", UPLINK_OUTSIDE)
    for destination in (*SERVICE_CIDRS[:1], EXTERNAL_NET):
        outside.run("ip", "route", "add", destination, "via", UPLINK_NODE)
    conf = bridge_conf(node.data_dir, dual_stack=True, hairpinMode=True)
    return ProxyNode(node, outside, name, kubeconfig, log_path, conf)


def node_object(name: str, zone: str = "zone-a") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"topology.kubernetes.io/zone": zone}},
        "status": {"addresses": [{"type": "InternalIP", "address": UPLINK_NODE}]},
    }


__all__ = ["UPLINK_NODE", "UPLINK_OUTSIDE"]
