"""A node namespace running knit-proxyd against the real control plane, pods attached to it
through the CNI plugin, an outside host, and the Kubernetes objects tests create."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.lab.controlplane import ControlPlane
from deploy.lab.kube import NODES, SERVICES, Kube, node_object, service_object
from deploy.lab.kube_proxy_node import kube_proxy_config, launch_kube_proxy
from deploy.lab.netns import Netns, unique_name
from deploy.lab.process import eventually
from deploy.lab.proxyd_node import NodeFiles, launch_proxyd, proxyd_flags
from deploy.lab.relay import NetnsForward
from tests.support.cni_env import UPLINK_NODE, UPLINK_OUTSIDE, Node, Pod, bridge_conf

SERVICE_CIDRS = ("10.96.0.0/16", "fd00:10:96::/112")
EXTERNAL_NET = "203.0.113.0/24"
CLUSTER_CIDRS = "10.244.0.0/16,fd10:244::/32"
LAST_SYNC = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
REMOTE_NODE = "node-elsewhere"
IPVS_LISTING = (
    sys.executable,
    "-c",
    "from proxyd.ipvs.netlink import IpvsKernel, open_socket\n"
    "kernel = IpvsKernel(open_socket())\n"
    "for family in (4, 6):\n"
    "    for f, info in kernel.services(family).items():\n"
    "        print(f'ipvs {f.address} {f.protocol} {f.port} timeout={info.timeout}')\n",
)
"""Prints the kernel's IPVS virtual servers (there is no ipvsadm in the test tools)."""


@dataclass
class ProxyNode:
    """The node under test: knit-proxyd (or, `kube_proxy`, the real kube-proxy in the same
    mode, for the tests that compare them) running in `node.ns`."""

    node: Node
    outside: Netns
    name: str
    kubeconfig: Path
    log_path: Path
    conf: dict[str, Any]
    mode: str = "iptables"
    process: subprocess.Popen[bytes] | None = None
    args: list[str] = field(default_factory=list)
    forward: Any = None
    """The NetnsForward that lets the node reach the API server (stop it: API down)."""
    kube_proxy: bool = False

    @property
    def ns(self) -> Netns:
        return self.node.ns

    def start(self, *extra: str) -> None:
        folder = self.log_path.parent
        if self.kube_proxy:
            assert not extra, "kube-proxy takes its settings from its config"
            config = kube_proxy_config(
                self.kubeconfig,
                self.name,
                CLUSTER_CIDRS,
                self.mode,
                "127.0.0.1:10249",
                minSyncPeriod="100ms",
            )
            self.process = launch_kube_proxy(self.ns, config, folder, self.log_path)
            self._until_synced()
            return
        self.args = proxyd_flags(
            self.kubeconfig,
            self.name,
            CLUSTER_CIDRS,
            NodeFiles(folder / "net.d", folder / "bin", self.node.data_dir),
            "--min-sync-period", "100ms",
            "--v", "4",
            *extra,
            mode=self.mode,
        )  # fmt: skip
        self.process = launch_proxyd(self.ns, self.args, self.log_path)
        self._until_synced()

    def _until_synced(self) -> None:
        try:
            eventually(lambda: self.synced_after(0.0), what="the daemon's first sync")
        except TimeoutError as err:
            tail = self.log_path.read_text(errors="replace").splitlines()[-30:]
            raise AssertionError("\n".join([str(err), *tail])) from None

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
        """One sample; KeyError when the daemon does not serve it."""
        _, body = self.http("http://127.0.0.1:10249/metrics")
        prefix = f"{name}{{{labels}}} " if labels else f"{name} "
        for line in body.splitlines():
            if line.startswith(prefix):
                return float(line.split()[-1])
        raise KeyError(f"no sample {prefix.strip()} in the daemon's metrics")

    def synced_after(self, moment: float) -> bool:
        """Both families' parts of a sync done after `moment` (epoch seconds)."""
        return all(self.metric(LAST_SYNC, f'ip_family="IPv{family}"') > moment for family in (4, 6))

    def iptables(self, table: str = "nat", family: int = 4) -> str:
        binary = "iptables-save" if family == 4 else "ip6tables-save"
        return self.ns.run(binary, "-t", table).stdout

    def rules(self) -> str:
        """Everything the datapath programmed, as its tools print it (both families)."""
        if self.mode == "nftables":
            return "".join(
                self.ns.run("nft", "list", "table", family, "knit", check=False).stdout
                for family in ("ip", "ip6")
            )
        rules = "".join(self.iptables(t, f) for t in ("nat", "filter") for f in (4, 6))
        if self.mode == "ipvs":
            rules += self.ns.run("ipset", "save").stdout + self.ns.run(*IPVS_LISTING).stdout
        return rules

    def add_pod(self, container_id: str, *ports: tuple[int, str]) -> Pod:
        """A pod answering with its container id on each (port, proto), IPv4 and IPv6."""
        pod = self.node.add_pod(self.conf, container_id)
        for port, proto in ports:
            pod.ns.serve("::", port, proto, container_id)
        return pod


def setup_node(
    node: Node,
    outside: Netns,
    name: str,
    kubeconfig: Path,
    log_path: Path,
    mode: str = "iptables",
    kube_proxy: bool = False,
) -> ProxyNode:
    node.connect_outside(outside)
    node.ns.run("ip", "route", "add", "default", "via", UPLINK_OUTSIDE)
    for destination in (*SERVICE_CIDRS[:1], EXTERNAL_NET):
        outside.run("ip", "route", "add", destination, "via", UPLINK_NODE)
    conf = bridge_conf(node.data_dir, dual_stack=True, hairpinMode=True)
    return ProxyNode(node, outside, name, kubeconfig, log_path, conf, mode, kube_proxy=kube_proxy)


@contextmanager
def running_proxy_node(
    control_plane: ControlPlane,
    kube: Kube,
    node_ns: Netns,
    make_netns: Callable[[str], Netns],
    tmp: Path,
    mode: str = "iptables",
    name: str = "",
    kube_proxy: bool = False,
) -> Iterator[ProxyNode]:
    """knit-proxyd (or kube-proxy) started in node_ns as a Node of the API server (reached
    through a NetnsForward), with an outside host; stopped, with its forward, even when
    start-up fails. Without a name, a new Node is created; with one, it is that Node's."""
    forward = NetnsForward(node_ns.name, control_plane.port, target_host=control_plane.host)
    proxy: ProxyNode | None = None
    try:
        if not name:
            name = unique_name("node")
            kube.create(NODES, node_object(name, [UPLINK_NODE], zone="zone-a"))
        proxy = setup_node(
            Node(node_ns, tmp / "ipam", make_netns),
            make_netns("outside"),
            name,
            control_plane.write_kubeconfig(tmp / "kubeconfig", forward.listen_port),
            tmp / "proxyd.log",
            mode,
            kube_proxy,
        )
        proxy.forward = forward
        proxy.start()
        yield proxy
    finally:
        if proxy is not None:
            proxy.stop()
            forward = proxy.forward  # a test may have replaced it
        forward.stop()


HTTP = {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}
SLICE_HTTP = [{"name": "http", "port": 8080, "protocol": "TCP"}]


def create_service(
    kube: Kube, name: str, ports: list[dict[str, Any]] | None = None, **spec: Any
) -> dict[str, Any]:
    return kube.create(SERVICES, service_object(name, ports or [HTTP], **spec))
