"""The local lab: a three-node cluster in network namespaces, no Docker, no cloud.

`up` starts a real etcd and kube-apiserver, two underlay segments joined by a router, three
nodes (node1 and node2 on lan1, routed directly; node3 on lan2, reached over VXLAN) each
running knit-proxyd (which installs the plugin, writes the CNI config and routes pod
traffic), a web backend on every node attached through the CNI plugin by libcni, a client pod,
an outside host, and a NodePort Service over the backends. It then shows, in plain words,
that the traffic flows, and leaves everything running. `down` removes all of it.
Everything a node keeps on its disk lives under the lab's folder (default .lab/).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

from deploy.lab import controlplane
from deploy.lab.cluster import ECHO, PYTHON, Cluster, LabPod, stop_recorded

ROOT = Path(__file__).resolve().parents[2]
KUBECTL = ROOT / "build" / "controlplane" / "kubectl"
NODES = {
    "node1": ("lan1", 11, ("10.244.1.0/24", "fd10:244:0:1::/64")),
    "node2": ("lan1", 12, ("10.244.2.0/24", "fd10:244:0:2::/64")),
    "node3": ("lan2", 13, ("10.244.3.0/24", "fd10:244:0:3::/64")),
}


def build_bundle(output: Path) -> Path:
    subprocess.run(
        [PYTHON, "-m", "cni.bundle", "--output", str(output)],
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return output


class Lab:
    def __init__(self, prefix: str, folder: Path) -> None:
        self.prefix = prefix
        self.folder = folder

    @property
    def plane_dir(self) -> Path:
        return self.folder / "controlplane"

    def up(self) -> bool:
        self.folder.mkdir(parents=True)
        print("starting etcd and kube-apiserver ...", flush=True)
        plane = controlplane.start(self.plane_dir, detach=True)
        print("building the CNI plugin bundle the node daemons install ...", flush=True)
        bundle = build_bundle(self.folder / "cni-bundle")
        cluster = Cluster(self.prefix, self.folder, plane, bundle)
        segments = {
            "lan1": cluster.add_segment("lan1", "10.77.1.0/24", "fd77:1::/64"),
            "lan2": cluster.add_segment("lan2", "10.77.2.0/24", "fd77:2::/64"),
        }
        for name, (segment, index, pod_cidrs) in NODES.items():
            print(f"starting {name} and its knit-proxyd ...", flush=True)
            cluster.add_node(name, segments[segment], index, pod_cidrs)
        outside = cluster.add_host("outside", segments["lan2"], 99)
        web = [cluster.add_pod(node, f"web-{node.name}") for node in cluster.nodes.values()]
        client = cluster.add_pod(cluster.nodes["node1"], "client")
        service = cluster.publish("web", web, type="NodePort")
        return self.demonstrate(cluster, web, client, outside, service)

    def demonstrate(
        self, cluster: Cluster, web: list[LabPod], client: LabPod, outside: str, service: dict
    ) -> bool:
        print("\nknit lab is up: a real API server, 3 nodes running knit-proxyd, 4 pods")
        for node in cluster.nodes.values():
            print(
                f"  {node.name} ({node.ns}): {node.segment.name} {node.addresses[0]}, "
                f"pods {', '.join(node.pod_cidrs)}, files under {node.folder}"
            )
        cluster_ip = service["spec"]["clusterIP"]
        node_port = service["spec"]["ports"][0]["nodePort"]
        node2 = cluster.nodes["node2"]
        checks = [
            (
                f"pod-to-pod across nodes, direct route: client on node1 -> {web[1].name}",
                cluster.request(client.ns, web[1].address()),
                (client.address(), web[1].address()),
            ),
            (
                f"pod-to-pod across segments, over VXLAN: client on node1 -> {web[2].name}",
                cluster.request(client.ns, web[2].address()),
                (client.address(), web[2].address()),
            ),
            (
                f"pod-to-pod over IPv6: client -> {web[2].name} at {web[2].address(6)}",
                cluster.request(client.ns, web[2].address(6)),
                (client.address(6), web[2].address(6)),
            ),
        ]
        ok = True
        for label, got, want in checks:
            ok &= self.report(label, got == want, f"server saw {got[0] or 'nothing'}")
        answered = {cluster.request(client.ns, cluster_ip)[1] for _ in range(12)}
        ok &= self.report(
            f"pod-to-Service: client -> ClusterIP {cluster_ip}:80",
            answered <= {pod.address() for pod in web} and len(answered) > 1,
            f"answered by {', '.join(sorted(answered))}",
        )
        seen, by = cluster.request(outside, node2.addresses[0], node_port)
        ok &= self.report(
            f"external-to-NodePort: outside host -> {node2.addresses[0]}:{node_port}",
            by in {pod.address() for pod in web},
            f"answered by {by or 'nobody'}, which saw {seen or 'nothing'}",
        )
        kubectl = KUBECTL if KUBECTL.exists() else "kubectl"
        print("\npoke at it:")
        print(f"  export KUBECONFIG={cluster.control_plane.kubeconfig}")
        print(f"  {kubectl} get nodes,services,endpointslices -o wide")
        print(f"  ip netns exec {client.ns} {PYTHON} {ECHO} request {cluster_ip} 80")
        print(f"  ip netns exec {outside} {PYTHON} {ECHO} request {node2.addresses[0]} {node_port}")
        print(f"  ip netns exec {cluster.nodes['node1'].ns} ip route")
        print(f"  ip netns exec {cluster.nodes['node1'].ns} iptables-save -t nat | grep KNIT")
        print(f"  less {cluster.nodes['node1'].log}")
        print("remove it: make lab-down")
        return ok

    @staticmethod
    def report(label: str, passed: bool, detail: str) -> bool:
        print(f"  {label}: {detail}: {'OK' if passed else 'FAILED'}")
        return passed

    def down(self) -> None:
        stop_recorded(self.folder)  # the daemons first: their watches would hold up the apiserver
        controlplane.down(self.plane_dir)
        shutil.rmtree(self.folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--prefix", default="knit-lab")
    parser.add_argument("--folder", type=Path, default=ROOT / ".lab")
    options = parser.parse_args()
    lab = Lab(options.prefix, options.folder.resolve())
    lab.down()
    if options.action == "down":
        return
    try:
        passed = lab.up()
    except BaseException:
        lab.down()
        raise
    if not passed:
        raise SystemExit("the lab is up, but a check failed (see above)")


if __name__ == "__main__":
    main()
