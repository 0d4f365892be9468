"""A hostile cluster, on the lab: attacks a tenant, a Node writer or a local caller can make,
made as they would make them (kubectl objects, a signal to the daemon, a flood of idle
connections), and for each the proof by packets that policy still holds for every other pod,
routes are unchanged and the daemon is healthy, with the offending object named in its log.

Policy and node networking are the same in every proxy mode, so these run in the nftables
mode's lab only."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.lab.lab import KUBECTL, Lab
from deploy.lab.process import eventually, in_ns

pytestmark = pytest.mark.timeout(900)

AGNHOST = "registry.k8s.io/e2e-test-images/agnhost:2.66.1"


@pytest.fixture
def hostile_lab(lab: Lab) -> Iterator[Lab]:
    if lab.mode != "nftables":
        pytest.skip("policy and node networking are the same in every mode: run in nftables")
    lab.deploy_demo()
    yield lab


def _apply(lab: Lab, *objects: dict[str, object]) -> None:
    manifest = json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
    lab.kubectl("apply", "-f", _write(lab, manifest))


def _write(lab: Lab, text: str) -> str:
    path = lab.folder / "hostile.json"
    path.write_text(text)
    return str(path)


def _server(namespace: str, name: str, node: str) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": namespace, "name": name, "labels": {"role": "server"}},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": node},
            "containers": [
                {"name": "web", "image": AGNHOST, "args": ["netexec", "--http-port=8080"]}
            ],
        },
    }


def _pod_ip(lab: Lab, namespace: str, name: str) -> str:
    lab.kubectl(
        "-n", namespace, "wait", "--for=condition=Ready", f"pod/{name}", "--timeout=120s",
        timeout=130,
    )  # fmt: skip
    pod = json.loads(lab.kubectl("-n", namespace, "get", "pod", name, "-o", "json"))
    return str(pod["status"]["podIP"])


def _answers(lab: Lab, address: str) -> bool:
    """Whether the demo's client pod (node1) gets an answer from address:8080."""
    try:
        lab.kubectl("exec", "client", "--", "curl", "-sS", "-m", "3", f"http://{address}:8080/")
    except RuntimeError:
        return False
    return True


def _knit_log(lab: Lab, node: str) -> str:
    pod = lab.kubectl(
        "-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=knit",
        "--field-selector", f"spec.nodeName={node}", "-o", "name",
    ).strip()  # fmt: skip
    return lab.kubectl("-n", "kube-system", "logs", pod)


def _knit_ready(lab: Lab) -> bool:
    """Whether knit's pod is Ready on every node of the lab (a Node object with no kubelet
    behind it gets one too, which never runs: knit tolerates every taint)."""
    listing = lab.kubectl(
        "-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=knit", "-o", "json"
    )  # fmt: skip
    ready = {
        pod["spec"].get("nodeName")
        for pod in json.loads(listing)["items"]
        if any(
            c["type"] == "Ready" and c["status"] == "True"
            for c in pod["status"].get("conditions", [])
        )
    }
    return ready >= lab.nodes.keys()


def test_a_pod_named_at_the_api_limit_does_not_switch_policy_off(hostile_lab: Lab) -> None:
    """Once a pod whose namespace and name passed nft's comment limit made node1's whole policy
    transaction fail, and the next pod there answered a client its policy denied."""
    lab = hostile_lab
    namespace = f"hostile-{'n' * 55}"
    # the longest name a kubelet runs beside a 63-character namespace: its log folder,
    # namespace_name_uid, must fit in a file name's 255 bytes (the API server takes 253)
    long_name = "l" * (255 - len(namespace) - 36 - 2)
    deny = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": namespace, "name": "deny-ingress"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
    }
    namespace_object = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    try:
        _apply(lab, namespace_object, deny, _server(namespace, long_name, "node1"))
        long_ip = _pod_ip(lab, namespace, long_name)
        _apply(lab, _server(namespace, "after", "node1"))
        after_ip = _pod_ip(lab, namespace, "after")
        assert not _answers(lab, long_ip), "the long-named pod is isolated"
        assert not _answers(lab, after_ip), "the pod made after it is isolated"
        log = _knit_log(lab, "node1")
        assert "policy sync failed" not in log and "comment too long" not in log
        assert _knit_ready(lab)
        lab.kubectl("-n", namespace, "delete", "networkpolicy", "deny-ingress")
        eventually(lambda: _answers(lab, after_ip), 30, what="the pod answers, undenied")
    finally:
        lab.kubectl("delete", "namespace", namespace, "--wait=false")


def _routes(lab: Lab) -> dict[str, str]:
    return {
        f"{name} IPv{family}": node.machine.run("ip", f"-{family}", "route", "show", "table", "all")
        for name, node in lab.nodes.items()
        for family in (4, 6)
    }


def _node(name: str, pod_cidrs: list[str], addresses: list[str]) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {"name": name, "labels": {"knit.test/hostile": "true"}},
        "spec": {
            "podCIDR": pod_cidrs[0],
            "podCIDRs": pod_cidrs,
            "taints": [{"key": "knit.test/hostile", "effect": "NoSchedule"}],
        },
        "status": {"addresses": [{"type": "InternalIP", "address": a} for a in addresses]},
    }


def test_node_objects_cannot_steer_routes(hostile_lab: Lab) -> None:
    """Whoever may write Node objects writes ones claiming every address, the underlay, another
    node's pods and address, a pod's address, and an address with text after it: every node's
    routes stay as they were, and pods still reach each other across nodes directly and over
    VXLAN."""
    lab = hostile_lab
    node2 = json.loads(lab.kubectl("get", "node", "node2", "-o", "json"))
    node2_cidrs = node2["spec"]["podCIDRs"]
    node2_address = lab.nodes["node2"].addresses[0]
    # an address inside node1's pod CIDR: a pod's, whose source node1's policies would trust
    node1_cidr = json.loads(lab.kubectl("get", "node", "node1", "-o", "json"))["spec"]["podCIDR"]
    node1_pod = str(ipaddress.ip_network(node1_cidr)[250])
    before = _routes(lab)
    hostile = [
        _node("hostile-everything", ["0.0.0.0/0", "::/0"], ["10.77.1.201"]),
        _node("hostile-underlay", ["10.77.1.0/24"], ["10.77.1.202"]),
        _node("hostile-twin", node2_cidrs, [node2_address]),
        _node("hostile-squatter", ["10.244.201.0/24"], [node1_pod]),
        # the API server validates podCIDRs, not status addresses
        _node("hostile-text", ["10.244.200.0/24"], ["2001:db8::5%a\nflush ruleset", "224.0.0.1"]),
    ]
    try:
        _apply(lab, *hostile)
        eventually(
            lambda: all("hostile-text" in _knit_log(lab, node) for node in lab.nodes),
            60,
            what="every knit-proxyd heard of the hostile Nodes",
        )
        assert _routes(lab) == before
        checks = lab.checks()
        assert [check for check in checks if not check.passed] == []
        assert _knit_ready(lab)
    finally:
        lab.kubectl("delete", "node", "-l", "knit.test/hostile=true", "--wait=false")


def _daemon_pid(lab: Lab, node: str) -> int:
    """knit-proxyd's process on the node (the lab's nodes are process trees of this host)."""
    for pid in lab.nodes[node].machine.cgroup.pids():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"knit-proxyd") for arg in argv[:2]):
            return pid
    raise AssertionError(f"no knit-proxyd on {node}")


def _threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Threads:")).split()[1])


def test_a_stopped_daemon_does_not_hold_pod_networking_up(hostile_lab: Lab) -> None:
    """knit-proxyd stopped (SIGSTOP) on node2: a pod made there still gets its network, and one
    deleted there goes, through the plugin's deadlines and its in-process fallback."""
    lab = hostile_lab
    pid = _daemon_pid(lab, "node2")
    os.kill(pid, signal.SIGSTOP)
    began = time.monotonic()
    try:
        _apply(lab, _server("default", "while-stopped", "node2"))
        address = _pod_ip(lab, "default", "while-stopped")
        networked = time.monotonic() - began
        assert _answers(lab, address)
        lab.kubectl("delete", "pod", "while-stopped", "--timeout=60s", timeout=70)
    finally:
        os.kill(pid, signal.SIGCONT)
    print(f"a pod on a node with knit-proxyd stopped answered after {networked:.1f} s")
    eventually(lambda: _knit_ready(lab), 60, what="knit Ready after it went on")


IDLE = 2000
HOLD_IDLE = (
    'for i in $(seq "$N"); do exec {fd}<>"/dev/tcp/$HOST/$PORT" || break; done; '
    'echo opened; sleep "$HOLD"'
)


def test_idle_connections_to_the_health_port_hold_no_threads(hostile_lab: Lab) -> None:
    """A pod opens 2,000 connections to node1's healthz port (reachable from every pod, as
    kube-proxy's is) and sends nothing: knit-proxyd's threads stay where they were, and
    /healthz still answers the outside host at once."""
    lab = hostile_lab
    pid = _daemon_pid(lab, "node1")
    before = _threads(pid)
    node1 = lab.nodes["node1"].addresses[0]
    holder = subprocess.Popen(
        [str(KUBECTL), f"--kubeconfig={lab.kubeconfig}", "exec", "client", "--",
         "env", f"N={IDLE}", f"HOST={node1}", "PORT=10256", "HOLD=20", "bash", "-c", HOLD_IDLE],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "opened"
        during = _threads(pid)
        answer = in_ns(
            lab.outside, "curl", "-sS", "-m", "2", "-o", "/dev/null", "-w", "%{http_code}",
            f"http://{node1}:10256/healthz",
        )  # fmt: skip
    finally:
        holder.kill()
        holder.wait()
    print(f"knit-proxyd threads: {before} before, {during} with {IDLE} idle connections")
    assert answer == "200"
    assert during <= before + 4, (before, during)


# A root process with the fast path's folder mounted asks knit-proxyd to run its own IPAM
# plugin, kept in that folder, with the daemon's capabilities. The plugin leaves a mark if it
# ever runs; the copy of the compiled client talks to the node's socket.
BORROW = r"""
printf '#!/bin/sh\ntouch /run/knit/borrowed-ran\necho "{}"\n' > /run/knit/borrowed
chmod 755 /run/knit/borrowed
mkdir -p /tmp/client/knit.d
cp /opt/knit/cni-bundle/bin/knit /tmp/client/knit
printf 'plugin=absent\nsocket=/run/knit/cni.sock\n' > /tmp/client/knit.d/launch
echo '{"cniVersion":"1.0.0","name":"knit","type":"knit","ipam":{"type":"borrowed"}}' |
  CNI_COMMAND=ADD CNI_CONTAINERID=borrower CNI_NETNS=/proc/self/ns/net CNI_IFNAME=eth9 \
  CNI_PATH=/run/knit /tmp/client/knit
echo "exit $?"
"""


def _borrower(name: str, user: int) -> dict[str, object]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": "default", "name": name},
        "spec": {
            "nodeSelector": {"kubernetes.io/hostname": "node1"},
            "restartPolicy": "Never",
            "securityContext": {"runAsUser": user},
            "containers": [
                {
                    "name": "borrower",
                    "image": "knit:dev",
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", BORROW],
                    "volumeMounts": [{"name": "run-knit", "mountPath": "/run/knit"}],
                }
            ],
            "volumes": [{"name": "run-knit", "hostPath": {"path": "/run/knit"}}],
        },
    }


def _finished_log(lab: Lab, name: str) -> str:
    def finished() -> bool:
        pod = json.loads(lab.kubectl("get", "pod", name, "-o", "json"))
        return pod["status"].get("phase") in ("Succeeded", "Failed")

    eventually(finished, 120, what=f"{name} finished")
    return lab.kubectl("logs", name)


def test_the_fast_path_lends_no_capability_to_a_local_caller(hostile_lab: Lab) -> None:
    """A root pod with the socket's folder mounted gets its plugin refused (the daemon runs
    delegated plugins from its own bin dirs only); a non-root one cannot reach the socket."""
    lab = hostile_lab
    folder = lab.nodes["node1"].folder / "run/knit"
    mark = folder / "borrowed-ran"
    try:
        _apply(lab, _borrower("borrower-root", 0), _borrower("borrower-nobody", 65534))
        as_root = _finished_log(lab, "borrower-root")
        as_nobody = _finished_log(lab, "borrower-nobody")
        print(f"as root: {as_root.strip()}\nas nobody: {as_nobody.strip()}")
        assert "exit 0" not in as_root and "not found" in as_root, as_root
        assert "exit 0" not in as_nobody, as_nobody
        assert not mark.exists(), "the borrowed plugin never ran"
        assert folder.stat().st_mode & 0o777 == 0o700
        assert _knit_ready(lab)
    finally:
        lab.kubectl("delete", "pod", "borrower-root", "borrower-nobody", "--wait=false")
        for leftover in (mark, folder / "borrowed"):
            leftover.unlink(missing_ok=True)


def _carved_policy(namespace: str, name: str, holes: int) -> dict[str, object]:
    """Ingress from 10.0.0.0/8 but `holes` /30s of 10.128.0.0/9, far from the pods."""
    excepted = [f"10.{128 + (n >> 14)}.{(n >> 6) & 255}.{(n & 63) * 4}/30" for n in range(holes)]
    block = {"ipBlock": {"cidr": "10.0.0.0/8", "except": excepted}}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [block]}]},
    }


def test_an_ip_block_with_thousands_of_excepts_neither_stalls_nor_opens(hostile_lab: Lab) -> None:
    """20,000 except entries (what knit takes) compile at once on the node and allow what they
    allow; 20,001 are not read, and the policy's pods are isolated (fail closed)."""
    lab = hostile_lab
    namespace = "hostile-excepts"
    namespace_object = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}
    try:
        _apply(lab, namespace_object, _server(namespace, "server", "node1"))
        address = _pod_ip(lab, namespace, "server")
        # create, not apply: apply would copy the object into an annotation, past its limit
        lab.kubectl(
            "create", "-f", _write(lab, json.dumps(_carved_policy(namespace, "wide", 20_000)))
        )
        assert eventually(lambda: _answers(lab, address), 30, what="allowed by the ipBlock")
        syncs = [line for line in _knit_log(lab, "node1").splitlines() if "policy sync:" in line]
        print(f"node1's policy sync with 20,000 except entries: {syncs[-1]}")
        lab.kubectl("-n", namespace, "delete", "networkpolicy", "wide")
        too_many = _carved_policy(namespace, "too-many", 20_001)
        lab.kubectl("create", "-f", _write(lab, json.dumps(too_many)))
        eventually(lambda: not _answers(lab, address), 30, what="isolated, nothing allowed")
        assert "over knit's 20000" in _knit_log(lab, "node1")
        assert _knit_ready(lab)
    finally:
        lab.kubectl("delete", "namespace", namespace, "--wait=false")
