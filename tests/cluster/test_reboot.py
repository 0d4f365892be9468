"""A lab node rebooted (deploy/lab/reboot.py): its processes killed, its network namespace, its
pods' namespaces and its /run gone, its /var/lib kept, then booted again. The node must come
back Ready with its pods answering from another node, knit-proxyd running, and nothing of the
old boot left: no address reservation and no veth without a pod."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from deploy.lab.lab import Lab
from deploy.lab.process import eventually
from deploy.lab.reboot import reboot

# the fixture's lab takes minutes to come up when this module runs alone
pytestmark = pytest.mark.timeout(3600)

REBOOTED = "node3"  # on lan2: the other nodes reach its pods over VXLAN
CLIENT_NODE = "node1"
NAMESPACE = "reboot"
STORE = "var/lib/cni/networks/knit"
AGNHOST = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"
# fetch every URL given, one line each, up to the first that fails (its line curl's error): a
# poll that fails takes a second at most, which is the resolution of the measured boot time
FETCH = 'for u; do curl -sS -m 1 -g "$u" 2>&1 || exit 0; echo; done'


def _manifest(folder: Path) -> Path:
    """Two web pods pinned to the rebooted node, a dual-stack ClusterIP over them and a client
    on another node, in a namespace of their own."""
    web = {"matchLabels": {"app": "rebooted"}}
    objects: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "rebooted", "namespace": NAMESPACE},
            "spec": {
                "replicas": 2,
                "selector": web,
                "template": {
                    "metadata": {"labels": web["matchLabels"]},
                    "spec": {
                        "nodeSelector": {"kubernetes.io/hostname": REBOOTED},
                        "containers": [
                            {
                                "name": "web",
                                "image": AGNHOST,
                                "args": ["netexec", "--http-port=8080"],
                                "readinessProbe": {"httpGet": {"path": "/healthz", "port": 8080}},
                            }
                        ],
                    },
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "rebooted", "namespace": NAMESPACE},
            "spec": {
                "ipFamilyPolicy": "PreferDualStack",
                "selector": web["matchLabels"],
                "ports": [{"port": 80, "targetPort": 8080}],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "client", "namespace": NAMESPACE},
            "spec": {
                "nodeSelector": {"kubernetes.io/hostname": CLIENT_NODE},
                "containers": [{"name": "client", "image": AGNHOST, "args": ["pause"]}],
            },
        },
    ]
    path = folder / "reboot.json"
    path.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
    return path


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    return f"http://{host}:{port}/hostname"


def _fetch(lab: Lab, *urls: str) -> list[str]:
    """What the URLs answered a pod on another node, up to the first unanswered (curl's
    error)."""
    out = lab.kubectl("-n", NAMESPACE, "exec", "client", "--", "sh", "-c", FETCH, "sh", *urls)
    return out.splitlines()


def _pods(lab: Lab, *selector: str) -> list[dict[str, Any]]:
    listed = lab.kubectl("get", "pods", *selector, "-o", "json")
    pods: list[dict[str, Any]] = json.loads(listed)["items"]
    return pods


def _web(lab: Lab) -> list[dict[str, Any]]:
    return _pods(lab, "-n", NAMESPACE, "-l", "app=rebooted")


def _addresses(pod: dict[str, Any]) -> list[str]:
    return [ip["ip"] for ip in pod["status"].get("podIPs", [])]


def _answered_by(lab: Lab, urls: list[str], names: list[str]) -> list[str]:
    """What the URLs answered, each by one of names (AssertionError, saying what, if not)."""
    answers = _fetch(lab, *urls)
    if len(answers) != len(urls) or not set(answers) <= set(names):
        raise AssertionError(f"{urls} answered {answers}")
    return answers


def _answering(lab: Lab) -> list[str] | None:
    """The web pods' names once every address of each answers from the client's node."""
    pods = [pod for pod in _web(lab) if pod["status"].get("phase") == "Running"]
    if len(pods) != 2:
        return None
    expected = [pod["metadata"]["name"] for pod in pods for _ in _addresses(pod)]
    urls = [_url(address, 8080) for pod in pods for address in _addresses(pod)]
    return expected if urls and _fetch(lab, *urls) == expected else None


def _node_state(lab: Lab) -> dict[str, Any]:
    """The rebooted node's reservations and pod veths, beside its pods as the API has them."""
    node = lab.nodes[REBOOTED]
    store = node.folder / STORE
    reserved = sorted(p.name for p in store.iterdir() if p.name[0].isdigit() or ":" in p.name)
    # pods' veths on knit's bridge (the node's own leg is a veth too)
    veths = node.machine.run("ip", "-o", "link", "show", "master", "knit0").count("\n")
    pods = [
        pod
        for pod in _pods(lab, "-A", "--field-selector", f"spec.nodeName={REBOOTED}")
        if not pod["spec"].get("hostNetwork")
    ]
    return {
        "reserved": reserved,
        "pod addresses": sorted(address for pod in pods for address in _addresses(pod)),
        "veths": veths,
        "pods": len(pods),
        "not running": sorted(
            pod["metadata"]["name"]
            for pod in pods
            if pod["status"].get("phase") != "Running" or pod["metadata"].get("deletionTimestamp")
        ),
    }


def _settled(lab: Lab) -> dict[str, Any] | None:
    state = _node_state(lab)
    matches = state["reserved"] == state["pod addresses"] and state["veths"] == state["pods"]
    return state if matches and not state["not running"] else None


def _knit_ready(lab: Lab, since: datetime) -> bool:
    """Whether knit's pod on the rebooted node is Ready with knit-proxyd started since."""
    (pod,) = _pods(
        lab, "-n", "kube-system", "-l", "app.kubernetes.io/name=knit",
        "--field-selector", f"spec.nodeName={REBOOTED}",
    )  # fmt: skip
    started = pod["status"]["containerStatuses"][0]["state"].get("running", {}).get("startedAt")
    conditions = pod["status"].get("conditions", [])
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
    return ready and started is not None and datetime.fromisoformat(started) >= since


def test_a_rebooted_node_comes_back_with_nothing_of_its_old_boot(lab: Lab, tmp_path: Path) -> None:
    lab.kubectl("apply", "-f", str(_manifest(tmp_path)))
    try:
        lab.kubectl(
            "-n", NAMESPACE, "rollout", "status", "deployment/rebooted", "--timeout=180s",
            timeout=200,
        )  # fmt: skip
        lab.kubectl(
            "-n", NAMESPACE, "wait", "--for=condition=Ready", "pod/client", "--timeout=180s",
            timeout=200,
        )  # fmt: skip
        before = eventually(lambda: _answering(lab), 60, what="the web pods answering")
        old_reserved = _node_state(lab)["reserved"]

        # the API's times have whole seconds
        rebooted = datetime.now(UTC).replace(microsecond=0)
        node = reboot(lab, REBOOTED)
        names = eventually(
            lambda: _answering(lab), 300, what="the rebooted pods answering", interval=0.5
        )
        answering = time.monotonic() - node.containerd_started
        lab.wait_ready()
        eventually(lambda: _knit_ready(lab, rebooted), 120, what=f"knit Ready on {REBOOTED}")
        try:
            after = eventually(lambda: _settled(lab), 180, what=f"{REBOOTED} settled")
        except TimeoutError:
            after = _node_state(lab)
        print(
            f"\n{REBOOTED} rebooted: its pods answered from {CLIENT_NODE} {answering:.1f}s after "
            f"containerd started; reservations before {old_reserved}, after {after}"
        )
        assert sorted(names) == sorted(before)  # the same pods, started again
        assert after["not running"] == []
        assert after["reserved"] == after["pod addresses"]
        assert after["veths"] == after["pods"]
        service = json.loads(
            lab.kubectl("-n", NAMESPACE, "get", "service", "rebooted", "-o", "json")
        )
        cluster_ips = service["spec"]["clusterIPs"]
        assert len(cluster_ips) == 2
        # the endpoints are the pods' new addresses once they are Ready again
        lab.kubectl(
            "-n", NAMESPACE, "wait", "--for=condition=Ready", "pods", "-l", "app=rebooted",
            "--timeout=60s", timeout=70,
        )  # fmt: skip
        urls = [_url(ip, 80) for ip in cluster_ips]
        eventually(lambda: _answered_by(lab, urls, names), 30, what="the ClusterIPs answering")
    finally:
        lab.kubectl("delete", "namespace", NAMESPACE, "--timeout=120s", timeout=130)
