"""A local multi-node lab in network namespaces: no Docker, no cluster.

`up`: an underlay namespace with a bridge, two node namespaces on it, each with its own
/etc/cni/net.d, /opt/cni/bin and /var/lib/cni under the lab folder; pods attached through
the CNI plugin driven by libcni (as containerd would), routes between the nodes' pod
subnets, and a demonstration with real traffic. `down`: removes all of it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "build" / "tools" / "cnidriver"
PLUGINS = {
    "knit": ROOT / "build" / "cni" / "knit",
    "portmap": ROOT / "build" / "refcni" / "portmap",
}
ECHO = ROOT / "tests" / "echo.py"
UNDERLAY_SUBNET = "10.77.0.0/24"


@dataclass(frozen=True)
class LabNode:
    name: str
    underlay_ip: str
    pod_cidr: str


def sh(*argv: str, check: bool = True) -> str:
    return subprocess.run(argv, capture_output=True, text=True, check=check).stdout


def in_ns(ns: str, *argv: str, check: bool = True) -> str:
    return sh("ip", "netns", "exec", ns, *argv, check=check)


class Lab:
    def __init__(self, prefix: str, folder: Path) -> None:
        self.prefix = prefix
        self.folder = folder
        self.underlay = f"{prefix}-underlay"
        self.nodes = [
            LabNode(f"{prefix}-node{i}", f"10.77.0.1{i}", f"10.244.{i}.0/24") for i in (1, 2)
        ]

    def node_dir(self, node: LabNode) -> Path:
        return self.folder / node.name

    def add_namespace(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        with (self.folder / "namespaces").open("a") as record:
            record.write(name + "\n")
        in_ns(name, "ip", "link", "set", "lo", "up")

    def up(self) -> None:
        self.folder.mkdir(parents=True)
        self.add_namespace(self.underlay)
        in_ns(self.underlay, "ip", "link", "add", "underlay", "type", "bridge")
        in_ns(self.underlay, "ip", "link", "set", "underlay", "up")
        for index, node in enumerate(self.nodes):
            self.add_node(node, index)
        for node in self.nodes:
            for other in self.nodes:
                if other is not node:
                    in_ns(node.name, "ip", "route", "add", other.pod_cidr, "via", other.underlay_ip)
        pods = {
            node.name: [self.add_pod(node, f"web-{i}") for i in range(2)] for node in self.nodes
        }
        if not self.demonstrate(pods):
            raise SystemExit("the lab is up, but a check failed (see above)")

    def add_node(self, node: LabNode, index: int) -> None:
        self.add_namespace(node.name)
        port = f"port{index}"
        in_ns(
            self.underlay,
            "ip",
            "link",
            "add",
            port,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            node.name,
        )
        in_ns(self.underlay, "ip", "link", "set", port, "master", "underlay", "up")
        in_ns(node.name, "ip", "addr", "add", f"{node.underlay_ip}/24", "dev", "eth0")
        in_ns(node.name, "ip", "link", "set", "eth0", "up")
        base = self.node_dir(node)
        for sub in ("etc/cni/net.d", "opt/cni/bin", "var/lib/cni/networks", "var/lib/cni/cache"):
            (base / sub).mkdir(parents=True)
        for name, source in PLUGINS.items():
            shutil.copy2(source, base / "opt/cni/bin" / name)
        conflist = {
            "cniVersion": "1.1.0",
            "name": "knit",
            "plugins": [
                {
                    "type": "knit",
                    "bridge": "knit0",
                    "isDefaultGateway": True,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": node.pod_cidr}]],
                        "dataDir": str(base / "var/lib/cni/networks"),
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        (base / "etc/cni/net.d/10-knit.conflist").write_text(json.dumps(conflist, indent=2))

    def add_pod(self, node: LabNode, name: str) -> tuple[str, str]:
        pod_ns = f"{node.name}-{name}"
        self.add_namespace(pod_ns)
        base = self.node_dir(node)
        result = json.loads(
            in_ns(
                node.name,
                str(DRIVER),
                "add",
                "--conflist",
                str(base / "etc/cni/net.d/10-knit.conflist"),
                "--cni-path",
                str(base / "opt/cni/bin"),
                "--cache-dir",
                str(base / "var/lib/cni/cache"),
                "--netns",
                f"/var/run/netns/{pod_ns}",
                "--container-id",
                pod_ns,
                "--ifname",
                "eth0",
                "--args",
                f"IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name}",
            )
        )
        address = result["ips"][0]["address"].split("/")[0]
        subprocess.Popen(
            ["ip", "netns", "exec", pod_ns, sys.executable, str(ECHO), "serve", "0.0.0.0", "80"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return pod_ns, address

    def demonstrate(self, pods: dict[str, list[tuple[str, str]]]) -> bool:
        (_, a_ip), (b_ns, b_ip) = pods[self.nodes[0].name]
        (c_ns, c_ip), _ = pods[self.nodes[1].name]
        print("knit lab is up: 2 nodes, 2 pods each, attached by the knit CNI plugin via libcni")
        for node in self.nodes:
            print(
                f"  {node.name}: underlay {node.underlay_ip}, pods {node.pod_cidr}, "
                f"files under {self.node_dir(node)}"
            )
        checks = [("same node", b_ns, b_ip, a_ip), ("across nodes", c_ns, c_ip, a_ip)]
        all_ok = True
        for label, client_ns, client_ip, server_ip in checks:
            seen = self.request(client_ns, server_ip)
            all_ok = all_ok and seen == client_ip
            verdict = "OK" if seen == client_ip else "FAILED"
            print(
                f"  pod-to-pod {label}: {client_ns} ({client_ip}) -> {server_ip}:80, "
                f"server saw {seen}: {verdict}"
            )
        print("poke at it:")
        print(f"  ip netns exec {c_ns} {sys.executable} {ECHO} request {a_ip} 80")
        print(
            f"  ip netns exec {self.nodes[0].name} ip route; "
            f"ip netns exec {self.nodes[0].name} iptables-save -t nat"
        )
        print("remove it: make lab-down")
        return all_ok

    def request(self, ns: str, ip: str) -> str:
        for _ in range(20):
            out = in_ns(ns, sys.executable, str(ECHO), "request", ip, "80", check=False).split()
            if out:
                return out[0]
        return ""

    def down(self) -> None:
        record = self.folder / "namespaces"
        names = record.read_text().split() if record.exists() else []
        for name in reversed(names):
            for pid in sh("ip", "netns", "pids", name, check=False).split():
                subprocess.run(["kill", "-9", pid], check=False)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        shutil.rmtree(self.folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--prefix", default="knit-lab")
    parser.add_argument("--folder", type=Path, default=ROOT / ".lab")
    options = parser.parse_args()
    lab = Lab(options.prefix, options.folder)
    if options.action == "down":
        lab.down()
        return
    lab.down()
    try:
        lab.up()
    except SystemExit:
        raise
    except BaseException:
        lab.down()
        raise


if __name__ == "__main__":
    main()
