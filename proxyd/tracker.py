"""The cluster as the watches delivered it, and which services changed since the last sync.

Watch threads feed it; the sync thread takes the accumulated changes and a consistent view of
the services they touch. Objects the proxy cannot use are logged and left out.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cni.kernel.families import IP_FAMILIES
from proxyd.model import (
    Endpoint,
    EndpointSlice,
    NodeInfo,
    Obj,
    ServicePort,
    endpoints_for,
    family_of,
    ignored,
    parse_endpoint_slice,
    parse_node,
    parse_or_skip,
    parse_service,
    parse_service_cidr,
)
from proxyd.store import Store

ServiceKey = tuple[str, str]


@dataclass
class ServiceView:
    ports: list[ServicePort]
    endpoints: dict[ServicePort, tuple[Endpoint, ...]]


@dataclass
class Changes:
    """What one sync has to program."""

    services: dict[ServiceKey, ServiceView]
    """The changed services; a deleted one has no ports."""
    node: NodeInfo
    service_cidrs: tuple[str, ...] = ()
    """Every range of the cluster's ServiceCIDR objects, sorted."""
    trigger_times: dict[int, list[float]] = field(default_factory=dict)
    """Per IP family, when the changes to program were made, from the slices'
    last-change-trigger-time annotations (kube-proxy's network programming latency); one per
    changed service of that family."""
    service_changes: int = 0
    """Service events that changed something since the last sync (kube-proxy counts events)."""
    endpoint_changes: int = 0
    """EndpointSlice events that changed something since the last sync."""


def _cluster_ip_families(ports: list[ServicePort]) -> frozenset[int]:
    return frozenset(family_of(ip) for port in ports for ip in port.cluster_ips)


class ClusterState:
    """`on_change` hears the IP families each change touches (a Service: those of its cluster
    IPs before and after; a slice: its address type; the node: every family), so a family's
    sync is queued only by changes to it, as with kube-proxy's proxier per family; a fresh
    list always calls it, maybe with no family, so the first sync follows."""

    def __init__(
        self, node_name: str, on_change: Callable[[frozenset[int]], None] = lambda _: None
    ) -> None:
        self._lock = threading.Lock()
        self._on_change = on_change
        self._services = Store[list[ServicePort]]("Service", _ports, self._service_set)
        self._slices = Store[EndpointSlice]("EndpointSlice", _slice, self._slice_set)
        self._service_cidrs = Store[tuple[str, ...]](
            "ServiceCIDR", parse_service_cidr, self._service_cidr_set
        )
        """ServiceCIDR -> its ranges."""
        self._by_service: dict[ServiceKey, dict[str, EndpointSlice]] = {}
        """The slices of each service, by slice name."""
        self.node = NodeInfo(node_name)
        self._nodes_listed = False
        """Whether the first list of Nodes is in, so the node's own object if it has one: its
        addresses (where NodePorts listen by default) and zone (topology hints). A first sync
        without them wrote NodePort rules for no address until the Node came."""
        self._touched: set[int] = set()
        """The IP families the store changes under way touched."""
        self._pending_services: set[ServiceKey] = set()
        self._pending_endpoints: dict[int, set[ServiceKey]] = {}
        """Per IP family, the services whose slices of that family changed."""
        self._service_events = 0
        self._endpoint_events = 0
        self._trigger_times: dict[tuple[int, ServiceKey], float] = {}
        self._started = time.time()

    # ------------------------------------------------------------ feeding
    def ready(self) -> bool:
        with self._lock:
            return self._services.listed and self._slices.listed and self._nodes_listed

    def pending(self) -> tuple[int, Counter[int]]:
        """Services with changes to program, and per family those with endpoint changes."""
        with self._lock:
            families = {family: len(keys) for family, keys in self._pending_endpoints.items()}
            return len(self._pending_services), Counter(families)

    def _service_set(
        self, key: ServiceKey, old: list[ServicePort] | None, new: list[ServicePort] | None
    ) -> None:
        self._pending_services.add(key)
        self._service_events += 1
        self._touched |= _cluster_ip_families(old or []) | _cluster_ip_families(new or [])

    def _slice_set(
        self, key: tuple[str, str], old: EndpointSlice | None, new: EndpointSlice | None
    ) -> None:
        owners: set[ServiceKey] = set()
        if old is not None:
            owner = (old.namespace, old.service)
            owners.add(owner)
            del self._by_service[owner][old.name]
            if not self._by_service[owner]:
                del self._by_service[owner]
        if new is not None:
            owner = (new.namespace, new.service)
            owners.add(owner)
            self._by_service.setdefault(owner, {})[new.name] = new
            if new.trigger_time is not None and new.trigger_time > self._started:
                timed = (new.family, owner)
                self._trigger_times[timed] = min(
                    self._trigger_times.get(timed, new.trigger_time), new.trigger_time
                )
        families = {s.family for s in (old, new) if s is not None}
        for owner in owners:
            for family in families:
                self._pending_endpoints.setdefault(family, set()).add(owner)
        self._endpoint_events += 1
        self._touched |= families

    def _service_cidr_set(
        self, key: tuple[str, str], old: tuple[str, ...] | None, new: tuple[str, ...] | None
    ) -> None:
        self._touched |= {family_of(cidr) for cidr in set(old or ()) ^ set(new or ())}

    def _event(self, store: Store[Any], kind: str, obj: Obj) -> None:
        with self._lock:
            store.event(kind, obj)
            families, self._touched = frozenset(self._touched), set()
        if families:
            self._on_change(families)

    def _replace(self, store: Store[Any], objs: list[Obj]) -> None:
        """A fresh list; the list is emptied once the lock is let go (see store.py). It always
        calls on_change, maybe with no family, so that the first sync follows."""
        with self._lock:
            store.replace(objs)
            families, self._touched = frozenset(self._touched), set()
        objs.clear()
        self._on_change(families)

    def service_event(self, kind: str, obj: Obj) -> None:
        self._event(self._services, kind, obj)

    def slice_event(self, kind: str, obj: Obj) -> None:
        self._event(self._slices, kind, obj)

    def service_cidr_event(self, kind: str, obj: Obj) -> None:
        self._event(self._service_cidrs, kind, obj)

    def replace_services(self, objs: list[Obj]) -> None:
        self._replace(self._services, objs)

    def replace_slices(self, objs: list[Obj]) -> None:
        self._replace(self._slices, objs)

    def replace_service_cidrs(self, objs: list[Obj]) -> None:
        self._replace(self._service_cidrs, objs)

    def replace_node(self, obj: Obj | None) -> None:
        """A list of Nodes came: this node's object in it, None when it has none."""
        with self._lock:
            self._nodes_listed = True
        self.node_event("DELETED" if obj is None else "ADDED", obj or {})
        self._on_change(frozenset())  # as after any fresh list, so the first sync follows

    def node_event(self, kind: str, obj: Obj) -> None:
        with self._lock:
            node = (
                NodeInfo(self.node.name)
                if kind == "DELETED"
                else parse_or_skip(parse_node, obj, "Node") or self.node
            )
            families = frozenset(IP_FAMILIES) if node != self.node else frozenset()
            self.node = node
        if families:
            self._on_change(families)

    # ------------------------------------------------------------ taking
    def _view(self, key: ServiceKey) -> ServiceView:
        ports = self._services.items.get(key, [])
        slices = list(self._by_service.get(key, {}).values())
        return ServiceView(ports, {port: endpoints_for(port, slices) for port in ports})

    def take(self) -> Changes:
        """Every service changed since the last take, as it is now."""
        with self._lock:
            changed = self._pending_services.union(*self._pending_endpoints.values())
            trigger_times: dict[int, list[float]] = {}
            for (family, _), at in self._trigger_times.items():
                trigger_times.setdefault(family, []).append(at)
            changes = Changes(
                services={key: self._view(key) for key in changed},
                node=self.node,
                service_cidrs=tuple(
                    sorted({c for cs in self._service_cidrs.items.values() for c in cs})
                ),
                trigger_times=trigger_times,
                service_changes=self._service_events,
                endpoint_changes=self._endpoint_events,
            )
            self._pending_services.clear()
            self._pending_endpoints.clear()
            self._service_events = self._endpoint_events = 0
            self._trigger_times.clear()
            return changes


def _ports(obj: Obj) -> list[ServicePort] | None:
    """The ports the proxy programs for a Service; None (absent) for one another proxy owns,
    a headless or ExternalName one, or one without ports."""
    return None if ignored(obj) else parse_service(obj) or None


def _slice(obj: Obj) -> EndpointSlice | None:
    return None if ignored(obj) else parse_endpoint_slice(obj)
