"""The churn of a chaos run or a soak (deploy/lab/chaos.py, bench/soak.py): a workload in a
namespace of its own, and a thread changing it without pause.

- a stable Service (ClusterIP, NodePort, HTTP and UDP) over a DaemonSet of agnhost netexec
  pods, isolated by a NetworkPolicy that allows everything, so a policy that fails to hold
  shows as failed requests to it;
- a Deployment scaled between 0 and a maximum across the nodes, a Service over it whose port
  moves, and Services and NetworkPolicies over its pods made and deleted.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path
from typing import Any

from deploy.lab import audit
from deploy.lab.lab import Lab
from deploy.lab.process import eventually

NAMESPACE = "chaos"
AGNHOST = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
HTTP_PORT = 8080
NETPOLS = 3
EXTRA_SERVICES = 4


STABLE_CPU_REQUEST = "100m"
"""The stable Service's pods' CPU request. Without one they are BestEffort, whose cgroup
weighs 2 against the node daemons' 1024: while a knit pod starts on this 2-core machine,
such a pod went unscheduled for 1.2-1.4 s, and the steady clients counted its late answers
as failures of the network (a capture showed each datagram reach the pod at once)."""


def _netexec(labels: dict[str, str], cpu_request: str | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "web",
        "image": AGNHOST,
        "args": ["netexec", "--http-port=8080", "--udp-port=8081"],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}, "periodSeconds": 1},
    }
    if cpu_request is not None:
        container["resources"] = {"requests": {"cpu": cpu_request}}
    return {
        "metadata": {"labels": labels},
        "spec": {"terminationGracePeriodSeconds": 1, "containers": [container]},
    }


def _service(name: str, selector: dict[str, str], port: int, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "ipFamilyPolicy": "PreferDualStack",
            "selector": selector,
            "ports": [
                {"name": "http", "port": port, "targetPort": 8080, "protocol": "TCP"},
                {"name": "udp", "port": port + 1, "targetPort": 8081, "protocol": "UDP"},
            ],
            **spec,
        },
    }


def workload() -> list[dict[str, Any]]:
    """The stable Service's DaemonSet and its policy, and the churned Deployment (no replicas
    yet) with its Service."""
    stable, churned = {"app": "stable"}, {"app": "churned"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "stable", "namespace": NAMESPACE},
            "spec": {
                "selector": {"matchLabels": stable},
                "template": _netexec(stable, STABLE_CPU_REQUEST),
            },
        },
        _service("stable", stable, 80, type="NodePort"),
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "stable-open", "namespace": NAMESPACE},
            "spec": {"podSelector": {"matchLabels": stable}, "ingress": [{}]},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "churned", "namespace": NAMESPACE},
            "spec": {
                "replicas": 0,
                "selector": {"matchLabels": churned},
                "template": _netexec(churned),
            },
        },
        _service("churned", churned, 80),
    ]


def _churn_policy(index: int, rng: random.Random) -> dict[str, Any]:
    """A NetworkPolicy over the churned pods: ingress from the stable pods only, or no egress."""
    spec: dict[str, Any] = {"podSelector": {"matchLabels": {"app": "churned"}}}
    if rng.random() < 0.5:
        peer = {"podSelector": {"matchLabels": {"app": "stable"}}}
        spec["ingress"] = [{"from": [peer], "ports": [{"port": 8080}]}]
    else:
        spec["policyTypes"] = ["Egress"]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"churn-{index}", "namespace": NAMESPACE},
        "spec": spec,
    }


def apply(lab: Lab, objects: list[dict[str, Any]], folder: Path, name: str) -> None:
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    lab.kubectl("apply", "-f", str(path))


class Churn(threading.Thread):
    """Changes to the churned objects, one every half second or so, until stopped. A change
    the API server refuses (it may be restarting) is counted and passed over."""

    def __init__(self, lab: Lab, folder: Path, rng: random.Random, max_replicas: int) -> None:
        super().__init__(name="churn", daemon=True)
        self.lab, self.folder, self.rng, self.max_replicas = lab, folder, rng, max_replicas
        self.stopping = threading.Event()
        self.made = 0
        self.refused = 0

    def _scale(self) -> None:
        replicas = self.rng.randint(0, self.max_replicas)
        self.lab.kubectl("-n", NAMESPACE, "scale", "deployment/churned", f"--replicas={replicas}")

    def _port(self) -> None:
        port = self.rng.randrange(80, 90, 2)
        churned = _service("churned", {"app": "churned"}, port)
        apply(self.lab, [churned], self.folder, "churned-service")

    def _policy(self) -> None:
        index = self.rng.randrange(NETPOLS)
        if self.rng.random() < 0.5:
            apply(self.lab, [_churn_policy(index, self.rng)], self.folder, f"churn-{index}")
        else:
            self.lab.kubectl(
                "-n", NAMESPACE, "delete", "networkpolicy", f"churn-{index}", "--ignore-not-found"
            )  # fmt: skip

    def _extra_service(self) -> None:
        name = f"extra-{self.rng.randrange(EXTRA_SERVICES)}"
        if self.rng.random() < 0.5:
            extra = _service(name, {"app": "churned"}, self.rng.randrange(80, 90, 2))
            apply(self.lab, [extra], self.folder, name)
        else:
            self.lab.kubectl("-n", NAMESPACE, "delete", "service", name, "--ignore-not-found")

    def run(self) -> None:
        changes = (self._scale, self._port, self._policy, self._extra_service)
        while not self.stopping.wait(self.rng.uniform(0.2, 0.8)):
            try:
                self.rng.choice(changes)()
                self.made += 1
            except (RuntimeError, TimeoutError, OSError):
                self.refused += 1

    def stop(self) -> None:
        self.stopping.set()
        self.join()


def policies() -> list[str]:
    """The names of the NetworkPolicies the churn makes and deletes."""
    return [f"churn-{index}" for index in range(NETPOLS)]


def setup(lab: Lab, folder: Path) -> None:
    """The workload applied and its stable pods Ready, with the audit clean: the state a run
    (or bench/soak.py) starts from."""
    folder.mkdir(parents=True, exist_ok=True)
    apply(lab, workload(), folder, "workload")
    lab.kubectl(
        "-n", NAMESPACE, "rollout", "status", "daemonset/stable", "--timeout=180s", timeout=200
    )  # fmt: skip
    eventually(lambda: audit.settled(lab), 120, "the audit clean before the run")
