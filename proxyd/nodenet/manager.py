"""Keeps the node's networking in line with the Nodes the API server lists.

Fed by a list+watch of all Nodes; a worker thread applies the latest picture after each
change: the CNI config from this node's podCIDRs, the routes to the other nodes' pod CIDRs,
and the source NAT after routing (egress masquerade, peers' VTEP addresses). A failed apply
is retried. What a Node may not make this node do (route_plan.check_peers) is logged when it
first shows, not at every apply.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cni.kernel.rawnetlink import NetlinkSocket
from proxyd.iptables.kernel import IptablesKernel
from proxyd.model import parse_or_skip
from proxyd.nodenet import conflist, kernel
from proxyd.nodenet.route_plan import (
    NodeNet,
    PeerVtep,
    check_peers,
    parse_node_net,
    plan_routes,
    pod_mtu,
)
from proxyd.nodenet.routes import RouteTable, connected_networks, on_link, uplink_mtu
from proxyd.nodenet.source_nat import SourceNat

log = logging.getLogger(__name__)

RETRY_SECONDS = 5.0
DEFAULT_MTU = 1500


@dataclass(frozen=True)
class NodeNetworkOptions:
    node_name: str
    routing: str
    conf_dir: Path
    data_dir: str
    cluster_cidrs: tuple[str, ...]


class ReportedOnce:
    """Passes on the messages that were not in the last batch: a refusal is logged once while
    it stands, and again if it comes back after it went."""

    def __init__(self) -> None:
        self.standing: frozenset[str] = frozenset()

    def fresh(self, messages: Iterable[str]) -> list[str]:
        batch = list(dict.fromkeys(messages))
        new = [message for message in batch if message not in self.standing]
        self.standing = frozenset(batch)
        return new


class NodeNetwork:
    def __init__(self, options: NodeNetworkOptions, iptables: list[IptablesKernel]) -> None:
        self.options = options
        self.source_nat = [SourceNat(table) for table in iptables]
        self.nodes: dict[str, NodeNet] = {}
        self.lock = threading.Lock()
        self.changed = threading.Event()
        self.warnings = ReportedOnce()

    def replace(self, items: list[dict[str, Any]]) -> None:
        nodes = {}
        for obj in items:
            node = parse_or_skip(parse_node_net, obj, "Node")
            if node is not None:
                nodes[node.name] = node
        with self.lock:
            unchanged, self.nodes = self.nodes == nodes, nodes
        if not unchanged:
            self.changed.set()

    def event(self, kind: str, obj: dict[str, Any]) -> None:
        node = parse_or_skip(parse_node_net, obj, "Node")
        if node is None:
            return
        with self.lock:
            before = self.nodes.get(node.name)
            if kind == "DELETED":
                self.nodes.pop(node.name, None)
            else:
                self.nodes[node.name] = node
            unchanged = before == self.nodes.get(node.name)
        if not unchanged:  # most Node updates are status the routes do not depend on
            self.changed.set()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.changed.wait(timeout=1.0):
                continue
            self.changed.clear()
            try:
                self.apply()
            except Exception:
                log.exception("node networking failed; retrying in %.0fs", RETRY_SECONDS)
                stop.wait(RETRY_SECONDS)
                self.changed.set()

    def start(self, stop: threading.Event) -> threading.Thread:
        thread = threading.Thread(target=self.run, args=(stop,), name="node-network", daemon=True)
        thread.start()
        return thread

    def apply(self) -> None:
        with self.lock:
            nodes = list(self.nodes.values())
        local = next((n for n in nodes if n.name == self.options.node_name), None)
        if local is None:
            log.info("node %s is not registered yet", self.options.node_name)
            return
        routing = self.options.routing
        peer_vteps: tuple[PeerVtep, ...] = ()
        with kernel.route_socket() as sock:
            mtu = pod_mtu(self._uplink_mtu(sock, local), routing, local)
            if local.pod_cidrs:
                conf = conflist.render(local.pod_cidrs, self.options.data_dir, mtu)
                if conflist.write_if_changed(self.options.conf_dir, conf):
                    log.info("wrote the CNI config for %s", ", ".join(local.pod_cidrs))
            else:
                log.info("node %s has no podCIDR yet: no CNI config", local.name)
            warnings: list[str] = []
            if routing != "none":
                peers = check_peers(local, nodes, self.options.cluster_cidrs, connected_networks())
                plan = plan_routes(local, peers, routing, lambda ip: on_link(sock, ip))
                held = RouteTable(sock).apply(local, plan, mtu)
                warnings += [*map(str, peers.refused), *(f"cannot route {s}" for s in plan.skipped)]
                warnings += [f"route to {cidr} not added: {reason}" for cidr, reason in held]
                peer_vteps = plan.peer_vteps
            for warning in self.warnings.fresh(warnings):
                log.warning("%s", warning)
        # Accepted peers' pod CIDRs lie inside the cluster CIDR, so they need no exemption of
        # their own: no Node can widen the traffic that leaves unmasqueraded.
        exempt = self.options.cluster_cidrs + local.pod_cidrs
        for source_nat in self.source_nat:
            source_nat.apply(local.pod_cidrs, exempt, peer_vteps)
        log.info("node networking in place for %d nodes", len(nodes))

    @staticmethod
    def _uplink_mtu(sock: NetlinkSocket, local: NodeNet) -> int:
        if not local.internal_ips:
            return DEFAULT_MTU
        try:
            return uplink_mtu(sock, local.internal_ips[0])
        except (LookupError, OSError) as err:  # the link gone since its address was read
            log.warning("%s; assuming MTU %d", err, DEFAULT_MTU)
            return DEFAULT_MTU
