"""Which endpoints a service port uses on this node: readiness, terminating fallback
(KEP-1669), topology hints and the Local traffic policies, decided as kube-proxy does."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from proxyd.model import Endpoint, NodeInfo, ServicePort


@dataclass(frozen=True, slots=True)
class Categorized:
    cluster: tuple[Endpoint, ...]
    """Endpoints for Cluster traffic policies (empty when no policy is Cluster)."""
    local: tuple[Endpoint, ...]
    """Endpoints on this node for Local traffic policies (empty when no policy is Local)."""
    reachable: tuple[Endpoint, ...]
    """Every endpoint some rule of this node may send traffic to."""
    any_usable: bool
    """Whether the service has a usable endpoint anywhere in the cluster."""


def _filter(
    endpoints: tuple[Endpoint, ...], keep: Callable[[Endpoint], bool]
) -> tuple[Endpoint, ...]:
    return tuple(e for e in endpoints if keep(e))


def _topology_filter(
    endpoints: tuple[Endpoint, ...], node: NodeInfo
) -> Callable[[Endpoint], bool] | None:
    """Use hints only when every ready endpoint has one and some hint names this node/zone;
    None: every endpoint is in."""
    ready = [e for e in endpoints if e.ready]
    if not ready or not (ready[0].node_hints or ready[0].zone_hints):
        return None
    if all(e.node_hints for e in ready) and any(node.name in e.node_hints for e in ready):
        return lambda e: node.name in e.node_hints
    if (
        node.zone
        and all(e.zone_hints for e in ready)
        and any(node.zone in e.zone_hints for e in ready)
    ):
        return lambda e: node.zone in e.zone_hints
    return None


def categorize(port: ServicePort, endpoints: tuple[Endpoint, ...], node: NodeInfo) -> Categorized:
    cluster: tuple[Endpoint, ...] = ()
    any_usable = False
    if port.uses_cluster_endpoints:
        in_topology = _topology_filter(endpoints, node)
        if in_topology is None:
            cluster = tuple(e for e in endpoints if e.ready)
        else:
            cluster = _filter(endpoints, lambda e: e.ready and in_topology(e))
        if not cluster:
            cluster = _filter(endpoints, lambda e: e.serving and e.terminating)
        any_usable = bool(cluster)
    if not port.uses_local_endpoints:
        return Categorized(cluster, (), cluster, any_usable)

    def is_local(e: Endpoint) -> bool:
        return e.node_name == node.name

    any_usable = any_usable or any(e.ready or (e.serving and e.terminating) for e in endpoints)
    local = _filter(endpoints, lambda e: is_local(e) and e.ready)
    if not local:
        local = _filter(endpoints, lambda e: is_local(e) and e.serving and e.terminating)
    if not port.uses_cluster_endpoints:
        return Categorized((), local, local, any_usable)
    merged = {(e.ip, e.port): e for e in cluster + local}
    return Categorized(cluster, local, tuple(merged.values()), any_usable)
