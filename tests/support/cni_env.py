"""A node namespace with pods attached through the plugin, and what a test inspects there."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.lab.netns import Netns
from deploy.lab.paths import PLUGIN_DIR
from tests.conftest import CniAnswer, call_plugin

NETWORK = "knit-test"
SUBNET = "10.244.1.0/24"
SUBNET6 = "fd10:244:1::/64"
UPLINK_NODE, UPLINK_OUTSIDE = "198.18.0.1", "198.18.0.2"


def bridge_conf(data_dir: Path, *, dual_stack: bool = False, **options: Any) -> dict[str, Any]:
    ranges = [[{"subnet": SUBNET}]] + ([[{"subnet": SUBNET6}]] if dual_stack else [])
    return {
        "cniVersion": "1.1.0",
        "name": NETWORK,
        "type": "knit",
        "bridge": "kbr0",
        "isGateway": True,
        "isDefaultGateway": True,
        "ipam": {"type": "host-local", "ranges": ranges, "dataDir": str(data_dir)},
        **options,
    }


@dataclass
class Pod:
    ns: Netns
    container_id: str
    answer: CniAnswer

    @property
    def result(self) -> dict[str, Any]:
        assert self.answer.output is not None
        return self.answer.output

    def address(self, version: int = 4) -> str:
        for ip in self.result["ips"]:
            if (":" in ip["address"]) == (version == 6):
                return ip["address"].split("/")[0]
        raise AssertionError(f"no IPv{version} address in {self.result}")


@dataclass
class Node:
    ns: Netns
    data_dir: Path
    make_netns: Callable[[str], Netns]

    def add_pod(
        self,
        conf: dict[str, Any],
        container_id: str,
        ifname: str = "eth0",
        plugin: Path = PLUGIN_DIR / "knit",
    ) -> Pod:
        pod_ns = self.make_netns("pod")
        answer = call_plugin(
            self.ns,
            "ADD",
            conf,
            container_id=container_id,
            netns=pod_ns.path,
            ifname=ifname,
            plugin=plugin,
        )
        assert answer.code == 0, answer
        return Pod(pod_ns, container_id, answer)

    def call(
        self, command: str, conf: dict[str, Any] | bytes, pod: Pod | None = None, **kwargs: Any
    ) -> CniAnswer:
        if pod is not None:
            kwargs.setdefault("container_id", pod.container_id)
            kwargs.setdefault("netns", pod.ns.path)
        return call_plugin(self.ns, command, conf, **kwargs)

    def with_prev(self, conf: dict[str, Any], pod: Pod) -> dict[str, Any]:
        return {**conf, "prevResult": pod.result}

    def connect_outside(self, outside: Netns) -> None:
        """A veth between the node and an 'outside' host; the outside has no route to pods."""
        self.ns.run(
            "ip",
            "link",
            "add",
            "uplink",
            "type",
            "veth",
            "peer",
            "name",
            "wan",
            "netns",
            outside.name,
        )
        self.ns.run("ip", "addr", "add", f"{UPLINK_NODE}/24", "dev", "uplink")
        self.ns.run("ip", "link", "set", "uplink", "up")
        outside.run("ip", "addr", "add", f"{UPLINK_OUTSIDE}/24", "dev", "wan")
        outside.run("ip", "link", "set", "wan", "up")

    def reservations(self) -> list[str]:
        directory = self.data_dir / NETWORK
        if not directory.exists():
            return []
        return sorted(
            p.name
            for p in directory.iterdir()
            if p.name != "lock" and not p.name.startswith("last_reserved_ip.")
        )

    def veths(self) -> list[str]:
        links = json.loads(self.ns.run("ip", "-j", "link", "show", "type", "veth").stdout)
        return sorted(link["ifname"] for link in links if link["ifname"] != "uplink")

    def knit_rules(self) -> list[str]:
        rules = []
        for save in ("iptables-save", "ip6tables-save"):
            rules += [
                line
                for line in self.ns.run(save).stdout.splitlines()
                if "knit" in line.lower() and line.startswith("-A")
            ]
        nft = self.ns.run("nft", "list", "ruleset").stdout
        rules += [line.strip() for line in nft.splitlines() if 'comment "knit' in line]
        return rules

    def leftovers(self) -> dict[str, list[str]]:
        found = {
            "veths": self.veths(),
            "reservations": self.reservations(),
            "rules": self.knit_rules(),
        }
        return {k: v for k, v in found.items() if v}
