"""The local lab: a real three-node Kubernetes cluster in namespaces, no Docker, no cloud.

`up` starts a control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) on
host loopback, reachable from the lab's network through the gateway (deploy/lab/gateway.py);
two underlay segments joined by a router; three nodes (node1 and node2 on lan1, routed directly;
node3 on lan2, reached over VXLAN), each with its own containerd and kubelet in its own network
and mount namespaces (deploy/lab/kubenode.py); knit's image and the images the cluster needs,
built without Docker and imported into every node; knit installed from deploy/kubernetes, run
by the kubelets as a DaemonSet; CoreDNS. It then shows, with real pods of a Deployment, that
traffic flows, and leaves everything running. `down` removes all of it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from deploy.lab import controlplane, image
from deploy.lab.cluster import CLUSTER_CIDRS, PYTHON, Network, Segment, stop_recorded
from deploy.lab.kubenode import KubeNode
from deploy.lab.machine import Cgroup, Machine
from deploy.lab.paths import CONTROLPLANE_BIN, IMAGES, ROOT
from deploy.lab.process import eventually, in_ns, sh
from deploy.lab.runtime import BUILT, DEBIAN, Containerd

KUBECTL = CONTROLPLANE_BIN / "kubectl"
MANIFESTS = Path(__file__).resolve().parent / "manifests"
DEPLOY = ROOT / "deploy" / "kubernetes"
# name: (segment, host number, containerd): containerd 2.x on two nodes, 1.6 on one
NODES: dict[str, tuple[str, int, Containerd]] = {
    "node1": ("lan1", 11, BUILT),
    "node2": ("lan1", 12, BUILT),
    "node3": ("lan2", 13, DEBIAN),
}
CONTROL_PLANE_HOST = 2
PROXY_MODES = ("iptables", "nftables")


def knit_overlay(folder: Path, advertise: str, port: int, mode: str) -> Path:
    """A kustomization over deploy/kubernetes changing only what this cluster must: the API
    server's address, the proxy mode and the cluster CIDRs (both families here)."""
    folder.mkdir(parents=True, exist_ok=True)
    configmap = yaml.safe_load((DEPLOY / "configmap.yaml").read_text())
    settings = yaml.safe_load(configmap["data"]["config.yaml"])
    settings.update(mode=mode, clusterCIDR=",".join(CLUSTER_CIDRS))
    daemonset_env = [
        {"name": "KUBERNETES_SERVICE_HOST", "value": advertise},
        {"name": "KUBERNETES_SERVICE_PORT", "value": str(port)},
    ]
    patches = [
        {
            "apiVersion": "apps/v1",
            "kind": "DaemonSet",
            "metadata": {"name": "knit", "namespace": "kube-system"},
            "spec": {
                "template": {"spec": {"containers": [{"name": "knit", "env": daemonset_env}]}}
            },
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "knit-config", "namespace": "kube-system"},
            "data": {"config.yaml": yaml.safe_dump(settings)},
        },
    ]
    kustomization = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(DEPLOY, folder)],
        "patches": [{"patch": json.dumps(patch)} for patch in patches],
    }
    (folder / "kustomization.yaml").write_text(json.dumps(kustomization, indent=2))
    return folder


@dataclass(frozen=True)
class Endpoint:
    """Where nodes and pods reach the apiserver."""

    address: str
    port: int

    @property
    def server(self) -> str:
        return f"https://{self.address}:{self.port}"


@dataclass(frozen=True)
class Check:
    label: str
    passed: bool
    detail: str


def is_ready(api_object: dict[str, Any]) -> bool:
    """A Node's or a Pod's Ready condition is True."""
    conditions = api_object.get("status", {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


class Lab:
    def __init__(
        self, prefix: str, folder: Path, mode: str = "iptables", e2e_images: bool = False
    ) -> None:
        self.prefix = prefix
        self.folder = folder
        self.mode = mode
        self.e2e_images = e2e_images
        """Also import the images only the wider e2e selection runs (image.build_e2e_images)."""
        self.cgroup = Cgroup(prefix)
        self.network = Network(prefix, folder)
        self.nodes: dict[str, KubeNode] = {}
        self.outside = ""
        self.server = ""

    @property
    def plane_dir(self) -> Path:
        return self.folder / "controlplane"

    @property
    def kubeconfig(self) -> Path:
        return self.folder / "kubeconfig"

    def kubectl(self, *argv: str, timeout: float = 120) -> str:
        return sh(str(KUBECTL), f"--kubeconfig={self.kubeconfig}", *argv, timeout=timeout)

    def up(self) -> None:
        """Everything started, every node Ready with knit and CoreDNS running."""
        began = time.monotonic()
        self.folder.mkdir(parents=True)
        lan1 = self.network.add_segment("lan1", "10.77.1.0/24", "fd77:1::/64")
        lan2 = self.network.add_segment("lan2", "10.77.2.0/24", "fd77:2::/64")
        self.outside = self.network.add_host("outside", lan2, 99)
        plane = self._start_control_plane(lan1)
        self.server = plane.server
        print("building the images (knit, pause, agnhost, coredns) ...", flush=True)
        archives = list(image.build_lab_images(IMAGES).values())
        if self.e2e_images:
            archives += image.build_e2e_images(IMAGES).values()
        for name in NODES:
            self.boot_node(name, archives)
        print("installing knit from deploy/kubernetes and CoreDNS ...", flush=True)
        overlay = knit_overlay(self.folder / "knit", plane.address, plane.port, self.mode)
        self.kubectl("apply", "-k", str(overlay))
        self.kubectl("apply", "-f", str(MANIFESTS / "coredns.yaml"))
        self.wait_ready()
        print(f"all nodes Ready with knit running in {time.monotonic() - began:.0f}s")

    def node_ns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def node_leg(self, name: str) -> str:
        """The router's end of the node's leg onto its segment."""
        return f"{name}-port"

    def boot_node(self, name: str, archives: Sequence[Path] = ()) -> KubeNode:
        """Node NAME booted as the lab boots it: a fresh network namespace (lo up, nothing
        else set in it) with its leg on its segment at its host number, its machine, containerd
        with archives imported, kubelet. Its folder's files are the node's disk: whatever an
        earlier boot left there is kept."""
        segment_name, index, containerd = NODES[name]
        print(f"starting {name}: containerd ({containerd.name}) and kubelet ...", flush=True)
        segment = next(s for s in self.network.segments if s.name == segment_name)
        ns = self.network.add_namespace(self.node_ns(name))
        addresses = self.network.attach(ns, segment, index, self.node_leg(name))
        machine = Machine(ns, self.folder / name, f"{self.prefix}/{name}")
        machine.boot()
        node = KubeNode(name, machine, addresses, containerd)
        node.start_containerd()
        image.import_images(node.ctr(), archives)
        node.start_kubelet(self.plane_dir / "pki", self.server)
        self.nodes[name] = node
        return node

    def _start_control_plane(self, segment: Segment) -> Endpoint:
        """The control plane on host loopback, the gateway that makes it reachable at a host
        of segment, and the admin kubeconfig; returns where nodes and pods reach it."""
        print("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler ...")
        plane_ns = self.network.add_host("apiserver", segment, CONTROL_PLANE_HOST)
        advertise = segment.host(CONTROL_PLANE_HOST)[0]
        reach = controlplane.Reach(advertise, self.plane_dir / "egress.sock")
        self.plane_dir.mkdir()
        plane = controlplane.start(self.plane_dir, detach=True, reach=reach)
        self.network.spawn(
            [
                PYTHON, "-m", "deploy.lab.gateway",
                "--netns", plane_ns,
                "--address", advertise,
                "--apiserver-port", str(plane.port),
                "--egress-socket", str(reach.egress_socket),
                "--egress-netns", self.node_ns(next(iter(NODES))),
            ],
            self.folder / "gateway.log",
        )  # fmt: skip
        controlplane.start_controllers(plane, CLUSTER_CIDRS, detach=True)
        shutil.copy(plane.kubeconfig, self.kubeconfig)
        return Endpoint(advertise, plane.port)

    def wait_ready(self) -> None:
        names = list(self.nodes)
        for name in names:
            eventually(partial(self._node_ready, name), 180, what=f"{name} Ready", interval=1)
        self.kubectl(
            "-n", "kube-system", "rollout", "status", "daemonset/knit", "--timeout=180s",
            timeout=200,
        )  # fmt: skip
        self.kubectl(
            "-n", "kube-system", "rollout", "status", "deployment/coredns", "--timeout=180s",
            timeout=200,
        )  # fmt: skip

    def _node_ready(self, name: str) -> bool:
        return is_ready(json.loads(self.kubectl("get", "node", name, "-o", "json")))

    def deploy_demo(self) -> None:
        """A web Deployment spread over the nodes, a NodePort Service over it and a client pod
        on node1, all ready."""
        self.kubectl("apply", "-f", str(MANIFESTS / "demo.yaml"))
        self.kubectl("rollout", "status", "deployment/web", "--timeout=180s", timeout=200)
        self.kubectl("wait", "--for=condition=Ready", "pod/client", "--timeout=180s", timeout=200)

    def checks(self) -> list[Check]:
        """Checks made with real pods of the demo and a host outside the cluster."""
        self.deploy_demo()
        pods = json.loads(self.kubectl("get", "pods", "-l", "app=web", "-o", "json"))["items"]
        web = {pod["spec"]["nodeName"]: pod for pod in pods}
        client = json.loads(self.kubectl("get", "pod", "client", "-o", "json"))
        client_ips = [ip["ip"] for ip in client["status"]["podIPs"]]
        service = json.loads(self.kubectl("get", "service", "web", "-o", "json"))
        node_port = service["spec"]["ports"][0]["nodePort"]

        def fetch(url: str, *options: str) -> str:
            return self.kubectl(
                "exec", "client", "--", "curl", "-sS", "-m", "5", "-g", *options, url
            )  # fmt: skip

        checks = []
        for node_name, label in (("node2", "direct route"), ("node3", "over VXLAN")):
            pod = web[node_name]
            for ip in (entry["ip"] for entry in pod["status"]["podIPs"]):
                url = f"http://[{ip}]:8080/clientip" if ":" in ip else f"http://{ip}:8080/clientip"
                seen = fetch(url).rpartition(":")[0].strip("[]")
                name = pod["metadata"]["name"]
                checks.append(
                    Check(
                        f"pod-to-pod, {label}: client on node1 -> {name} at {ip}",
                        seen in client_ips,
                        f"server saw {seen or 'nothing'}",
                    )
                )
        answered = {fetch("http://web/hostname") for _ in range(12)}
        names = {pod["metadata"]["name"] for pod in pods}
        checks.append(
            Check(
                "pod-to-Service by DNS name: client -> http://web",
                answered <= names and len(answered) > 1,
                f"answered by {', '.join(sorted(answered))}",
            )
        )
        ca = "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt"
        version = json.loads(fetch("https://kubernetes.default.svc/version", "--cacert", ca))
        checks.append(
            Check(
                "pod-to-apiserver through the `kubernetes` Service",
                "gitVersion" in version,
                f"version {version.get('gitVersion')}",
            )
        )
        node2 = self.nodes["node2"].addresses[0]
        outside = in_ns(
            self.outside, "curl", "-sS", "-m", "5", f"http://{node2}:{node_port}/hostname",
            check=False,
        )  # fmt: skip
        checks.append(
            Check(
                f"outside-to-NodePort: a host on lan2 -> {node2}:{node_port}",
                outside in names,
                f"answered by {outside or 'nobody'}",
            )
        )
        return checks

    def show(self, checks: list[Check]) -> bool:
        print("\nknit lab is up:")
        for name, node in self.nodes.items():
            print(f"  {name}: Ready, {node.containerd.name}, files under {node.folder}")
        for check in checks:
            print(f"  {check.label}: {check.detail}: {'OK' if check.passed else 'FAILED'}")
        print("\npoke at it:")
        print(f"  export KUBECONFIG={self.kubeconfig}")
        print(f"  {KUBECTL} get nodes,pods -A -o wide")
        print(f"  {KUBECTL} exec client -- curl -s http://web/hostname")
        print(f"  less {self.nodes['node1'].folder / 'kubelet.log'}")
        print("remove it: make lab-down")
        return all(check.passed for check in checks)

    def down(self) -> None:
        # the nodes first (every process of theirs, pods included, by cgroup), then the
        # gateway and the namespaces, then the control plane
        self.cgroup.kill()
        self.cgroup.remove()
        stop_recorded(self.folder)
        controlplane.down(self.plane_dir)
        shutil.rmtree(self.folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--prefix", default="knit-lab")
    parser.add_argument("--folder", type=Path, default=ROOT / ".lab")
    parser.add_argument("--mode", choices=PROXY_MODES, default="iptables")
    options = parser.parse_args()
    lab = Lab(options.prefix, options.folder.resolve(), options.mode)
    lab.down()
    if options.action == "down":
        return
    try:
        lab.up()
        passed = lab.show(lab.checks())
    except KeyboardInterrupt:
        lab.down()
        raise
    except Exception as err:
        # what is up stays up to be looked at: the logs are in the nodes' folders
        raise SystemExit(f"the lab did not come up: {err}\nremove it: make lab-down") from err
    if not passed:
        raise SystemExit("the lab is up, but a check failed (see above)")


if __name__ == "__main__":
    main()
