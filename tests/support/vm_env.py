"""A VM node (deploy/lab/vm.py) in the tests' world: the control plane relayed to it, pods as
network namespaces on a bridge inside it, servers there, and knit-proxyd running in it."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from deploy.lab.controlplane import ControlPlane, kubeconfig_for
from deploy.lab.netns import ECHO
from deploy.lab.process import eventually
from deploy.lab.proxyd_node import NodeFiles, proxyd_flags
from deploy.lab.relay import NetnsForward
from deploy.lab.vm import GATEWAY, PYTHON, VmNode, VmProcess

API_PORT = 6443
CONTROL_PLANE = "/etc/knit/controlplane"
"""The host's control plane as the VM sees it: pki/ and admin.kubeconfig, the state dir
deploy.lab.controlplane.attached() reads (KNIT_CONTROL_PLANE for tests run in the VM)."""
KUBECONFIG = f"{CONTROL_PLANE}/admin.kubeconfig"
BRIDGE = "knit0"
BRIDGE_ADDRESS = "10.244.0.1"
CLUSTER_CIDR = "10.244.0.0/16"


@contextmanager
def api_access(node: VmNode, control_plane: ControlPlane) -> Iterator[str]:
    """The API server relayed to GATEWAY:6443 of the VM's uplink, and its state dir in the VM
    (CONTROL_PLANE; it yields the kubeconfig's path); the serving certificate names localhost,
    not the gateway, hence the kubeconfig's tls-server-name."""
    forward = NetnsForward(node.uplink.name, control_plane.port, API_PORT, GATEWAY)
    try:
        pki = control_plane.state_dir / "pki"
        for name in ("ca.crt", "admin.crt", "admin.key"):
            node.write(f"{CONTROL_PLANE}/pki/{name}", (pki / name).read_bytes(), 0o600)
        config = kubeconfig_for(Path(CONTROL_PLANE, "pki"), f"https://{GATEWAY}:{API_PORT}")
        clusters = config["clusters"]
        assert isinstance(clusters, list)
        clusters[0]["cluster"]["tls-server-name"] = "localhost"
        node.write(KUBECONFIG, json.dumps(config).encode(), 0o600)
        yield KUBECONFIG
    finally:
        forward.stop()


def make_bridge(node: VmNode) -> None:
    node.run("ip", "link", "add", BRIDGE, "type", "bridge")
    node.run("ip", "address", "add", f"{BRIDGE_ADDRESS}/24", "dev", BRIDGE)
    node.run("ip", "link", "set", BRIDGE, "up")


def add_pod(node: VmNode, name: str, address: str) -> None:
    """Namespace `name` in the VM, its eth0 at address/24 on the bridge, routed by the node."""
    script = f"""
        set -e
        ip netns add {name}
        ip link add veth-{name} type veth peer name eth0 netns {name}
        ip link set veth-{name} master {BRIDGE} up
        ip -n {name} link set lo up
        ip -n {name} address add {address}/24 dev eth0
        ip -n {name} link set eth0 up
        ip -n {name} route add default via {BRIDGE_ADDRESS}
    """
    node.run("sh", "-c", script)


def in_pod(pod: str, *argv: str) -> list[str]:
    return ["ip", "netns", "exec", pod, *argv] if pod else list(argv)


def serve(node: VmNode, pod: str, port: int, proto: str = "tcp") -> VmProcess:
    """echo.py serving on port in the pod, answering with the pod's name; once it listens."""
    log = f"/tmp/echo-{pod}-{proto}-{port}.log"
    server = node.spawn(
        in_pod(pod, PYTHON, str(ECHO), "serve", "0.0.0.0", str(port), proto, pod), log
    )
    eventually(lambda: "ready" in node.run("cat", log).stdout, what=f"{pod} serving {port}")
    return server


def request(node: VmNode, pod: str, host: str, port: int, proto: str = "tcp") -> tuple[str, str]:
    """(client address as the server saw it, the server's label) of one request from pod."""
    argv = in_pod(pod, PYTHON, str(ECHO), "request", host, str(port), proto)
    client, label = node.run(*argv, timeout=15).stdout.split()
    return client, label


def start_proxyd(node: VmNode, kubeconfig: str, name: str, mode: str) -> VmProcess:
    """knit-proxyd in the VM as node `name`, with its files under /var/lib/knit."""
    folders = [Path("/var/lib/knit", d) for d in ("net.d", "bin", "data")]
    node.run("mkdir", "-p", *map(str, folders))
    flags = proxyd_flags(
        Path(kubeconfig), name, CLUSTER_CIDR, NodeFiles(*folders),
        "--min-sync-period", "100ms", "--v", "4",
        mode=mode,
    )  # fmt: skip
    return node.spawn([PYTHON, "-m", "proxyd", *flags], f"/tmp/proxyd-{mode}.log")


def log_tail(node: VmNode, log: str) -> str:
    return node.run("sh", "-c", f"tail -n 40 {shlex.quote(log)}", check=False).stdout
