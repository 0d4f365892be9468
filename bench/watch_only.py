"""A watch-only knit-proxyd, or a watch-only kube-proxy: one process running the daemon's own
list+watch code (proxyd.watch.Reflector) into the state it feeds, with no datapath.

- `--kind knit`: what knit-proxyd watches with NetworkPolicy on (Daemon.run and
  Daemon._policy_reflectors): Services, EndpointSlices, every Node, ServiceCIDRs into the
  proxy's ClusterState and the node networking's Node table, and Pods (trimmed to
  pod_essentials as the daemon trims them), Namespaces, NetworkPolicies and
  ClusterNetworkPolicies into the policy's PolicyState. A thread takes both states' snapshots
  once a second after a change, as the daemon's syncs do, and holds the last ones.
- `--kind kube-proxy`: what kube-proxy watches, through the same code: Services,
  EndpointSlices and its own Node (a fieldSelector), into the same ClusterState.

It answers on stdout, one JSON line for each line read on stdin: the resources listed so far,
the watch events heard per kind, the sockets it holds, and its VmRSS and VmHWM (KiB). Run by
bench.api_watch_cost:
  python -m bench.watch_only --kind knit --kubeconfig FILE --node NAME
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from proxyd import kubeapi, watch
from proxyd.model import key_of
from proxyd.nodenet.manager import NodeNetwork, NodeNetworkOptions
from proxyd.policy.model import pod_essentials
from proxyd.policy.state import PolicyState
from proxyd.tracker import ClusterState

KINDS = ("knit", "kube-proxy")
CLUSTER_CIDR = "10.244.0.0/16"


def sockets(pid: int | str = "self") -> int:
    """The sockets a process holds open: a watch is a connection of its own (HTTP/1.1)."""
    found = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        # one closed meanwhile (the listing's own, say) is no socket
        with contextlib.suppress(FileNotFoundError):
            found += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return found


def memory_kib(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM of a process, KiB."""
    found = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            found[key] = int(rest.split()[0])
    return found


class Watcher:
    def __init__(self, api: kubeapi.Api, kind: str, node: str) -> None:
        self.stop = threading.Event()
        self.changed = threading.Event()
        self.state = ClusterState(node, on_change=lambda _: self.changed.set())
        self.policy = PolicyState(node, on_change=self.changed.set)
        self.node = node
        self.node_network = NodeNetwork(
            NodeNetworkOptions(node, "auto", Path("/nonexistent"), "", (CLUSTER_CIDR,)), []
        )
        self.listed: set[str] = set()
        self.events: dict[str, int] = {}
        self.held: tuple[object, ...] = ()
        """The last snapshots taken, as the daemon's proxier and enforcer hold theirs."""
        self.reflectors = [
            self._reflector(api, resource, on_replace, on_event)
            for resource, on_replace, on_event in self._resources(kind)
        ]

    def _resources(
        self, kind: str
    ) -> list[tuple[watch.Resource, Callable[[list[watch.Obj]], None], Callable[..., None]]]:
        state, policy = self.state, self.policy
        proxy = [
            (watch.services(), state.replace_services, state.service_event),
            (watch.endpoint_slices(), state.replace_slices, state.slice_event),
        ]
        if kind == "kube-proxy":
            own = watch.Resource(
                "Node", "/api/v1/nodes", field_selector=f"metadata.name={self.node}"
            )
            return [*proxy, (own, self._replace_own_node, state.node_event)]
        return [
            *proxy,
            (watch.nodes(), self._replace_nodes, self._node_event),
            (watch.service_cidrs(), state.replace_service_cidrs, state.service_cidr_event),
            (watch.pods(pod_essentials), policy.replace_pods, policy.pod_event),
            (watch.namespaces(), policy.replace_namespaces, policy.namespace_event),
            (watch.network_policies(), policy.replace_policies, policy.policy_event),
            (
                watch.cluster_network_policies(),
                policy.replace_cluster_policies,
                policy.cluster_policy_event,
            ),
        ]

    def _reflector(
        self,
        api: kubeapi.Api,
        resource: watch.Resource,
        on_replace: Callable[[list[watch.Obj]], None],
        on_event: Callable[[str, watch.Obj], None],
    ) -> watch.Reflector:
        kind = resource.kind
        self.events[kind] = 0

        def replaced(objs: list[watch.Obj]) -> None:
            on_replace(objs)
            self.listed.add(kind)

        def heard(event: str, obj: watch.Obj) -> None:
            self.events[kind] += 1
            on_event(event, obj)

        return watch.Reflector(api, resource, replaced, heard, self.stop)

    # the daemon's own hand-over of Nodes (Daemon._replace_nodes, Daemon._node_event)
    def _replace_nodes(self, items: list[watch.Obj]) -> None:
        self.node_network.replace(items)
        own = [item for item in items if key_of(item)[1] == self.node]
        self.state.replace_node(own[0] if own else None)

    def _node_event(self, kind: str, obj: watch.Obj) -> None:
        self.node_network.event(kind, obj)
        if key_of(obj)[1] == self.node:
            self.state.node_event(kind, obj)

    def _replace_own_node(self, items: list[watch.Obj]) -> None:
        self.state.replace_node(items[0] if items else None)

    def _snapshots(self) -> None:
        while not self.stop.is_set():
            if self.changed.wait(1.0):
                self.changed.clear()
                self.held = (self.state.take(), self.policy.take())
                self.stop.wait(1.0)

    def start(self) -> None:
        for reflector in self.reflectors:
            reflector.start()
        threading.Thread(target=self._snapshots, name="snapshots", daemon=True).start()

    def report(self) -> dict[str, object]:
        return {
            "listed": sorted(self.listed),
            "resources": len(self.reflectors),
            "events": dict(self.events),
            "sockets": sockets(),
            **memory_kib(),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--node", required=True)
    options = parser.parse_args()
    # as the daemon makes its client from --kubeconfig
    watcher = Watcher(kubeapi.from_kubeconfig([options.kubeconfig]), options.kind, options.node)
    print(json.dumps({"started": True, **memory_kib()}), flush=True)
    watcher.start()
    for _ in sys.stdin:
        print(json.dumps(watcher.report()), flush=True)
    watcher.stop.set()


if __name__ == "__main__":
    main()
