"""The lab's underlay (Network, which `make lab` builds on), and a kubelet-less cluster for tests.

A router namespace holds one bridge per underlay segment (an L2 network with an IPv4 and an
IPv6 subnet) and routes between segments. In the kubelet-less Cluster, a node is a namespace
with one leg on a segment,
its own copies of what a real node keeps on disk (etc/cni/net.d, opt/cni/bin, var/lib/cni,
run/knit) under the cluster's folder, a Node object in the API server, a relay to the API
server at 127.0.0.1:6443, and knit-proxyd, which installs the plugin from the bundle, writes
the CNI config and routes to the other nodes. A pod is a namespace attached by libcni (as a
runtime does) with the node's own config and plugin directory.

Everything made is recorded in the folder (namespaces, processes), so `down` can remove it
from another process.
"""

from __future__ import annotations

import ipaddress
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.lab.controlplane import ControlPlane
from deploy.lab.kube import (
    NODES,
    SERVICES,
    SLICES,
    Kube,
    api_client,
    endpoint,
    node_object,
    slice_object,
)
from deploy.lab.netns import ECHO, remove_namespace
from deploy.lab.paths import CNIDRIVER, REFERENCE_PLUGINS
from deploy.lab.process import detach, eventually, in_ns, sh, terminate
from deploy.lab.proxyd_node import NodeFiles, proxyd_argv, proxyd_flags

PORTMAP = REFERENCE_PLUGINS / "portmap"
PYTHON = sys.executable
CLUSTER_CIDRS = ("10.244.0.0/16", "fd10:244::/56")
ROUTER = "router"


@dataclass(frozen=True)
class Segment:
    name: str
    subnet4: ipaddress.IPv4Network
    subnet6: ipaddress.IPv6Network

    def host(self, index: int) -> tuple[str, str]:
        return str(self.subnet4[index]), str(self.subnet6[index])

    @property
    def gateways(self) -> tuple[str, str]:
        return self.host(1)


@dataclass
class LabNode:
    name: str
    ns: str
    segment: Segment
    addresses: tuple[str, str]
    pod_cidrs: tuple[str, ...]
    folder: Path
    daemon: int = 0
    forward: int = 0

    @property
    def conflist(self) -> Path:
        return self.folder / "etc/cni/net.d/10-knit.conflist"

    @property
    def bin_dir(self) -> Path:
        return self.folder / "opt/cni/bin"

    @property
    def data_dir(self) -> Path:
        return self.folder / "var/lib/cni/networks"

    @property
    def socket(self) -> Path:
        return self.folder / "run/knit/cni.sock"

    @property
    def log(self) -> Path:
        return self.folder / "knit-proxyd.log"


@dataclass(frozen=True)
class LabPod:
    name: str
    ns: str
    node: LabNode
    addresses: tuple[str, ...] = field(default=())

    def address(self, family: int = 4) -> str:
        return next(a for a in self.addresses if ipaddress.ip_address(a).version == family)


class Network:
    """The lab's underlay: namespaces on segments joined by a router, everything made recorded
    in folder (namespaces, processes) so `stop_recorded` can remove it from another process."""

    def __init__(self, prefix: str, folder: Path) -> None:
        self.prefix = prefix
        self.folder = folder
        self.router = f"{prefix}-{ROUTER}"
        self.segments: list[Segment] = []

    # ------------------------------------------------------------ bookkeeping

    def _record(self, kind: str, value: str) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        with (self.folder / kind).open("a") as record:
            record.write(value + "\n")

    def add_namespace(self, name: str) -> str:
        sh("ip", "netns", "add", name)
        self._record("namespaces", name)
        in_ns(name, "ip", "link", "set", "lo", "up")
        return name

    def spawn(self, argv: list[str], log: Path) -> int:
        pid = detach(argv, log)
        self._record("pids", str(pid))
        return pid

    # ------------------------------------------------------------ underlay

    def add_segment(self, name: str, subnet4: str, subnet6: str) -> Segment:
        segment = Segment(name, ipaddress.IPv4Network(subnet4), ipaddress.IPv6Network(subnet6))
        if not self.segments:
            self.add_namespace(self.router)
            in_ns(self.router, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            in_ns(self.router, "sysctl", "-qw", "net.ipv6.conf.all.forwarding=1")
        self.segments.append(segment)
        in_ns(self.router, "ip", "link", "add", name, "type", "bridge")
        in_ns(self.router, "ip", "link", "set", name, "up")
        gw4, gw6 = segment.gateways
        in_ns(self.router, "ip", "addr", "add", f"{gw4}/{segment.subnet4.prefixlen}", "dev", name)
        in_ns(
            self.router,
            "ip",
            "addr",
            "add",
            f"{gw6}/{segment.subnet6.prefixlen}",
            "dev",
            name,
            "nodad",
        )
        return segment

    def attach(self, ns: str, segment: Segment, index: int, port: str) -> tuple[str, str]:
        """A leg from ns onto the segment's bridge (as eth0) with host number index."""
        in_ns(
            self.router, "ip", "link", "add", port, "type", "veth", "peer", "name", "eth0",
            "netns", ns,
        )  # fmt: skip
        in_ns(self.router, "ip", "link", "set", port, "master", segment.name, "up")
        address4, address6 = segment.host(index)
        in_ns(ns, "ip", "addr", "add", f"{address4}/{segment.subnet4.prefixlen}", "dev", "eth0")
        in_ns(
            ns, "ip", "addr", "add", f"{address6}/{segment.subnet6.prefixlen}", "dev", "eth0",
            "nodad",
        )  # fmt: skip
        in_ns(ns, "ip", "link", "set", "eth0", "up")
        gw4, gw6 = segment.gateways
        in_ns(ns, "ip", "route", "add", "default", "via", gw4)
        in_ns(ns, "ip", "-6", "route", "add", "default", "via", gw6)
        return address4, address6

    def add_host(self, name: str, segment: Segment, index: int) -> str:
        """A plain machine on a segment (an outside client)."""
        ns = self.add_namespace(f"{self.prefix}-{name}")
        self.attach(ns, segment, index, f"{name}-port")
        return ns


class Cluster(Network):
    """Nodes that run knit-proxyd as a process, and pods that are namespaces attached by
    libcni, as a runtime would: the plugin and the daemon proven without kubelet."""

    def __init__(
        self,
        prefix: str,
        folder: Path,
        control_plane: ControlPlane,
        bundle: Path,
        routing: str = "auto",
    ) -> None:
        super().__init__(prefix, folder)
        self.control_plane = control_plane
        self.bundle = bundle
        self.routing = routing
        self.kube = Kube(api_client(control_plane.kubeconfig))
        self.nodes: dict[str, LabNode] = {}

    # ------------------------------------------------------------ nodes

    def add_node(
        self, name: str, segment: Segment, index: int, pod_cidrs: tuple[str, ...]
    ) -> LabNode:
        ns = self.add_namespace(f"{self.prefix}-{name}")
        addresses = self.attach(ns, segment, index, f"{name}-port")
        node = LabNode(name, ns, segment, addresses, pod_cidrs, self.folder / name)
        for sub in ("etc/cni/net.d", "opt/cni/bin", "var/lib/cni/networks", "run/knit"):
            (node.folder / sub).mkdir(parents=True, exist_ok=True)
        shutil.copy2(PORTMAP, node.bin_dir / "portmap")
        self.kube.create(NODES, node_object(name, addresses, pod_cidrs))
        self.nodes[name] = node
        self.start_daemon(node)
        return node

    def start_daemon(self, node: LabNode, *extra: str) -> None:
        if not node.forward:
            node.forward = self.spawn(
                [
                    PYTHON, "-m", "deploy.lab.relay",
                    "--netns", node.ns, "--target-port", str(self.control_plane.port),
                    "--target-host", self.control_plane.host,
                ],
                node.folder / "forward.log",
            )  # fmt: skip
        kubeconfig = self.control_plane.write_kubeconfig(node.folder / "kubeconfig", 6443)
        files = NodeFiles(
            node.conflist.parent, node.bin_dir, node.data_dir, str(node.socket), str(self.bundle)
        )
        flags = proxyd_flags(
            kubeconfig,
            node.name,
            ",".join(CLUSTER_CIDRS),
            files,
            "--min-sync-period", "200ms",
            "--metrics-bind-address", "127.0.0.1:10249",
            *extra,
            routing=self.routing,
        )  # fmt: skip
        node.daemon = self.spawn(proxyd_argv(node.ns, flags), node.log)
        eventually(node.socket.exists, 30, what=f"knit-proxyd on {node.name} serving its socket")

    def stop_daemon(self, node: LabNode) -> None:
        terminate(node.daemon)
        node.daemon = 0
        # a daemon ended by SIGKILL leaves its socket, which start_daemon waits for
        node.socket.unlink(missing_ok=True)

    def remove_node(self, node: LabNode) -> None:
        """The node leaves: its Node object goes, its machine goes away."""
        self.kube.delete(f"{NODES}/{node.name}")
        self.stop_daemon(node)
        terminate(node.forward)
        remove_namespace(node.ns)
        del self.nodes[node.name]

    # ------------------------------------------------------------ pods

    def add_pod(self, node: LabNode, name: str, port: int = 80) -> LabPod:
        """A pod attached by libcni with the node's config, serving echo.py on port."""
        ns = self.add_namespace(f"{self.prefix}-{name}")
        eventually(node.conflist.exists, 30, what=f"the CNI config on {node.name}")
        result = json.loads(self.cni(node, "add", ns, name))
        addresses = tuple(ip["address"].split("/")[0] for ip in result["ips"])
        self.serve(ns, port, node.folder / f"{name}.log")
        return LabPod(name, ns, node, addresses)

    def serve(self, ns: str, port: int, log: Path) -> None:
        """echo.py answering on port (both families) inside ns."""
        self.spawn(["ip", "netns", "exec", ns, PYTHON, str(ECHO), "serve", "::", str(port)], log)
        eventually(
            what=f"a server on {ns}:{port}", check=lambda: f":{port} " in in_ns(ns, "ss", "-ltnH")
        )

    def vanish(self, pod: LabPod) -> None:
        """The pod's namespace (and so its veth) goes away without a CNI DEL, as in a reboot."""
        remove_namespace(pod.ns)

    def cni(self, node: LabNode, verb: str, ns: str, name: str, namespace: str = "default") -> str:
        """Run verb (add, check, del) for a pod through libcni, as a runtime on node would."""
        return in_ns(
            node.ns, str(CNIDRIVER), verb,
            "--conflist", str(node.conflist),
            "--cni-path", str(node.bin_dir),
            "--cache-dir", str(node.folder / "var/lib/cni/cache"),
            "--netns", f"/var/run/netns/{ns}",
            "--container-id", ns,
            "--ifname", "eth0",
            "--args", f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name}",
        )  # fmt: skip

    def publish(self, name: str, pods: list[LabPod], port: int = 80, **spec: Any) -> dict[str, Any]:
        """A dual-stack Service over pods with its EndpointSlices (the controller's job)."""
        service = self.kube.create(
            SERVICES,
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": name},
                "spec": {
                    "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
                    "ipFamilyPolicy": "PreferDualStack",
                    **spec,
                },
            },
        )
        ports = [{"name": "http", "port": port, "protocol": "TCP"}]
        for family, address_type in ((4, "IPv4"), (6, "IPv6")):
            endpoints = [endpoint(pod.address(family), pod.node.name, ready=True) for pod in pods]
            self.kube.create(
                SLICES, slice_object(name, endpoints, ports, address_type=address_type)
            )
        return service

    # ------------------------------------------------------------ traffic

    def request(self, ns: str, host: str, port: int = 80, wait: float = 20.0) -> tuple[str, str]:
        """(client as the server saw it, server label), retried until an answer comes or wait
        seconds passed; ("", "") when nothing answered."""
        deadline = time.monotonic() + wait
        while True:
            out = in_ns(ns, PYTHON, str(ECHO), "request", host, str(port), check=False, timeout=15)
            client, _, label = out.strip().partition(" ")
            if client or time.monotonic() > deadline:
                return client, label
            time.sleep(0.2)

    # ------------------------------------------------------------ teardown

    def down(self) -> None:
        self.kube.cleanup()
        stop_recorded(self.folder)
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *_: object) -> None:
        """Everything the cluster made goes, however the block ended."""
        self.down()


def stop_recorded(folder: Path) -> None:
    """Stop every process and delete every namespace recorded in folder."""
    pids = folder / "pids"
    for pid in reversed(pids.read_text().split() if pids.exists() else []):
        terminate(int(pid))
    record = folder / "namespaces"
    for name in reversed(record.read_text().split() if record.exists() else []):
        remove_namespace(name)
