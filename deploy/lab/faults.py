"""Faults injected into a lab node (deploy/lab/chaos.py), and knit-proxyd's process there.

Each fault waits for the node to recover: Ready again, and after knit's own faults (and a
reboot) a new knit-proxyd Ready; after a reboot, the steady clients' Service served from the
node's new pod; after a kubelet restart, the new kubelet healthy (the Node stays Ready over a
short restart).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from deploy.lab import controlplane
from deploy.lab.lab import Lab, is_ready
from deploy.lab.process import eventually, terminate
from deploy.lab.reboot import reboot

KNIT = "app.kubernetes.io/name=knit"
FAULT_KINDS = (
    "knit-proxyd killed",
    "knit pod deleted",
    "containerd restarted",
    "kubelet restarted",
    "kube-apiserver restarted",
    "node rebooted",
)
RECOVERY = 180.0
KUBELET_HEALTHZ = "http://127.0.0.1:10248/healthz"


class NodeClients(Protocol):
    """Clients in nodes' network namespaces, which a reboot takes away with the namespace."""

    def stop(self, node: str) -> None: ...

    def start(self, node: str) -> None: ...

    def served_from(self, node: str) -> bool:
        """Whether the clients' Service has its endpoint on node back (after a reboot)."""
        ...


def _knit_pod(lab: Lab, node: str) -> dict[str, Any] | None:
    listed = lab.kubectl(
        "-n", "kube-system", "get", "pods", "-l", KNIT,
        "--field-selector", f"spec.nodeName={node}", "-o", "json",
    )  # fmt: skip
    pods: list[dict[str, Any]] = json.loads(listed)["items"]
    return pods[0] if len(pods) == 1 else None


def _knit_started(lab: Lab, node: str) -> str:
    pod = _knit_pod(lab, node)
    status = pod["status"]["containerStatuses"][0] if pod else {}
    started: str = status.get("state", {}).get("running", {}).get("startedAt", "")
    return started


def _knit_ready_since(lab: Lab, node: str, since: datetime) -> bool:
    """knit's pod on node Ready, its container started at or after since."""
    pod = _knit_pod(lab, node)
    if pod is None or pod["metadata"].get("deletionTimestamp"):
        return False
    started = _knit_started(lab, node)
    return is_ready(pod) and bool(started) and datetime.fromisoformat(started) >= since


def proxyd_pid(lab: Lab, node: str) -> int | None:
    """knit-proxyd's pid on node (found in the node's cgroup), if it runs."""
    for pid in lab.nodes[node].machine.cgroup.pids():
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if any(arg.endswith(b"knit-proxyd") for arg in argv[:2]):
                return pid
    return None


def _kill_proxyd(lab: Lab, node: str) -> None:
    pid = proxyd_pid(lab, node)
    if pid is None:
        raise RuntimeError(f"no knit-proxyd on {node}")
    os.kill(pid, signal.SIGKILL)


def _delete_knit_pod(lab: Lab, node: str) -> None:
    pod = _knit_pod(lab, node)
    if pod is None:
        raise RuntimeError(f"no knit pod on {node}")
    lab.kubectl("-n", "kube-system", "delete", "pod", pod["metadata"]["name"], "--wait=false")


def _restart_containerd(lab: Lab, node: str) -> None:
    kube_node = lab.nodes[node]
    terminate(kube_node.containerd_pid)
    kube_node.start_containerd()


def _restart_kubelet(lab: Lab, node: str) -> None:
    kube_node = lab.nodes[node]
    terminate(kube_node.kubelet_pid)
    kube_node.start_kubelet(lab.plane_dir / "pki", lab.server)


def _restart_apiserver(lab: Lab, node: str) -> None:
    controlplane.restart_apiserver(lab.plane_dir)


INJECT: dict[str, Callable[[Lab, str], None]] = {
    "knit-proxyd killed": _kill_proxyd,
    "knit pod deleted": _delete_knit_pod,
    "containerd restarted": _restart_containerd,
    "kubelet restarted": _restart_kubelet,
    "kube-apiserver restarted": _restart_apiserver,
}


@dataclass(frozen=True)
class Fault:
    kind: str
    node: str
    began: float
    """Wall-clock time of the injection."""
    recovered_after: float
    """Seconds until the node was Ready again with knit running (and, after knit's own faults,
    a new knit-proxyd Ready; after a reboot, the clients' Service served from it again)."""


def inject(lab: Lab, kind: str, node: str, clients: NodeClients) -> Fault:
    # the API's times have whole seconds
    since = datetime.now(UTC).replace(microsecond=0)
    began, start = time.time(), time.monotonic()
    if kind == "node rebooted":
        clients.stop(node)
        reboot(lab, node)
        clients.start(node)
    else:
        INJECT[kind](lab, node)
    if kind in ("knit-proxyd killed", "knit pod deleted", "node rebooted"):
        what = f"a new knit-proxyd Ready on {node}"
        eventually(partial(_knit_ready_since, lab, node, since), RECOVERY, what, interval=0.5)
    eventually(partial(lab._node_ready, node), RECOVERY, f"{node} Ready", interval=0.5)
    if kind == "node rebooted":
        # the node's pods come back with new addresses: until the Service's endpoints say so,
        # clients still reach for the old ones, and their failures belong to the reboot
        served = partial(clients.served_from, node)
        eventually(served, RECOVERY, f"the Service's endpoint on {node} back", interval=0.5)
    if kind == "kubelet restarted":
        # the Node stays Ready over a short restart: wait for the new kubelet itself
        healthz = partial(lab.nodes[node].machine.run, "curl", "-sf", KUBELET_HEALTHZ)
        eventually(healthz, RECOVERY, f"kubelet on {node} healthy", interval=0.5)
    return Fault(kind, node, began, time.monotonic() - start)


@dataclass(frozen=True)
class Footprint:
    """knit-proxyd's threads, open file descriptors and resident memory (KiB) on a node."""

    threads: int
    fds: int
    rss_kib: int


def footprint(lab: Lab, node: str) -> Footprint:
    pid = proxyd_pid(lab, node)
    if pid is None:
        raise RuntimeError(f"no knit-proxyd on {node}")
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return Footprint(
        threads=int(status["Threads"]),
        fds=len(os.listdir(f"/proc/{pid}/fd")),
        rss_kib=int(status["VmRSS"].split()[0]),
    )


def footprint_growth(before: Footprint, after: Footprint) -> list[str]:
    """What grew past its level before the run: any thread or more than 8 descriptors (a
    sync's sockets may be open when sampled), or memory by more than a quarter."""
    grown = []
    if after.threads > before.threads:
        grown.append(f"threads {before.threads} -> {after.threads}")
    if after.fds > before.fds + 8:
        grown.append(f"fds {before.fds} -> {after.fds}")
    if after.rss_kib > before.rss_kib * 1.25:
        grown.append(f"memory {before.rss_kib} -> {after.rss_kib} KiB")
    return grown
