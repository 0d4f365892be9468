"""Kubernetes objects created through the real client as raw JSON, and removed again."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from kubernetes.client import ApiClient
from kubernetes.config import new_client_from_config

from proxyd.model import ZONE_LABEL

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
SERVICES = "/api/v1/namespaces/default/services"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
NODES = "/api/v1/nodes"


def api_client(kubeconfig: Path) -> ApiClient:
    # the kubernetes client leaves new_client_from_config unannotated: it makes an ApiClient
    client: ApiClient = new_client_from_config(config_file=str(kubeconfig))
    return client


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
        created: dict[str, Any] = self.call("POST", collection, obj)
        self.created.append(f"{collection}/{created['metadata']['name']}")
        return created

    def patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        patched: dict[str, Any] = self.call("PATCH", path, patch, "application/merge-patch+json")
        return patched

    def delete(self, path: str) -> None:
        self.call("DELETE", path)
        if path in self.created:
            self.created.remove(path)

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> None:
        """A namespace with its default ServiceAccount (the service account controller's
        work, which pods need and a control plane without controllers does not do)."""
        self.create("/api/v1/namespaces", {"metadata": {"name": name, "labels": labels or {}}})
        self.create(f"/api/v1/namespaces/{name}/serviceaccounts", {"metadata": {"name": "default"}})

    def install_crd(self, manifest: Path, timeout: float = 30) -> str:
        """The CustomResourceDefinition of a manifest, created and waited for until it is
        served; its path, for delete()."""
        created = self.create(CRDS, yaml.safe_load(manifest.read_text()))
        path = f"{CRDS}/{created['metadata']['name']}"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            conditions = (self.call("GET", path).get("status") or {}).get("conditions") or []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return path
            time.sleep(0.2)
        raise TimeoutError(f"{path} not established after {timeout} s")

    def create_running_pod(
        self, namespace: str, pod: dict[str, Any], addresses: Sequence[str]
    ) -> None:
        """A Pod object, then the status kubelet writes once its sandbox has addresses."""
        self.create(f"/api/v1/namespaces/{namespace}/pods", pod)
        self.call(
            "PATCH",
            f"/api/v1/namespaces/{namespace}/pods/{pod['metadata']['name']}/status",
            pod_status(addresses),
            "application/merge-patch+json",
        )

    def cleanup(self) -> None:
        for path in reversed(self.created):
            with contextlib.suppress(RuntimeError):
                self.call("DELETE", path)
        self.created.clear()


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


def node_object(
    name: str, addresses: Sequence[str], pod_cidrs: Sequence[str] = (), zone: str = ""
) -> dict[str, Any]:
    """A Node as kubelet and the node IPAM controller leave it: InternalIPs, its hostname,
    its pod CIDRs when given, its zone label when given."""
    node: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {ZONE_LABEL: zone} if zone else {}},
        "status": {
            "addresses": [{"type": "InternalIP", "address": a} for a in addresses]
            + [{"type": "Hostname", "address": name}]
        },
    }
    if pod_cidrs:
        node["spec"] = {"podCIDR": pod_cidrs[0], "podCIDRs": list(pod_cidrs)}
    return node


def pod_object(
    name: str,
    node: str,
    labels: dict[str, str],
    ports: Sequence[tuple[str, int, str]] = (),
) -> dict[str, Any]:
    """A Pod bound to node, with named container ports (name, number, protocol)."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "main",
                    "image": "registry.k8s.io/pause:3.10",
                    "ports": [
                        {"name": n, "containerPort": number, "protocol": protocol}
                        for n, number, protocol in ports
                    ],
                }
            ],
        },
    }


def pod_status(addresses: Sequence[str]) -> dict[str, Any]:
    """The status kubelet writes once the pod's sandbox has its addresses."""
    return {
        "status": {
            "phase": "Running",
            "podIP": addresses[0],
            "podIPs": [{"ip": address} for address in addresses],
        }
    }
