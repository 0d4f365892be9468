"""The cluster as the watches delivered it, and which services changed since the last sync.

Watch threads feed it; the sync thread takes the accumulated changes and a consistent view of
the services they touch. Objects the proxy cannot use are logged and left out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime

from cni.families import IP_FAMILIES
from proxyd.model import (
    Endpoint,
    EndpointSlice,
    NodeInfo,
    Obj,
    ServicePort,
    endpoints_for,
    family_of,
    ignored,
    key_of,
    parse_endpoint_slice,
    parse_node,
    parse_or_skip,
    parse_service,
    parse_service_cidr,
)

log = logging.getLogger(__name__)

ServiceKey = tuple[str, str]
TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"


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


def _trigger_time(obj: Obj) -> float | None:
    """The slice's last-change-trigger-time annotation; None when absent or unreadable."""
    annotations = obj.get("metadata", {}).get("annotations") or {}
    stamp = annotations.get(TRIGGER_TIME_ANNOTATION)
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


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
        self._services: dict[ServiceKey, list[ServicePort]] = {}
        self._slices: dict[ServiceKey, dict[str, EndpointSlice]] = {}
        self._slice_owner: dict[tuple[str, str], ServiceKey] = {}
        self.node = NodeInfo(node_name)
        self._service_cidrs: dict[str, tuple[str, ...]] = {}
        """ServiceCIDR name -> its ranges."""
        self._pending_services: set[ServiceKey] = set()
        self._pending_endpoints: dict[int, set[ServiceKey]] = {}
        """Per IP family, the services whose slices of that family changed."""
        self._service_events = 0
        self._endpoint_events = 0
        self._trigger_times: dict[tuple[int, ServiceKey], float] = {}
        self._started = time.time()
        self._listed: set[str] = set()

    # ------------------------------------------------------------ feeding
    def ready(self) -> bool:
        with self._lock:
            return {"services", "endpointslices"} <= self._listed

    def pending(self) -> tuple[int, Counter[int]]:
        """Services with changes to program, and per family those with endpoint changes."""
        with self._lock:
            families = {family: len(keys) for family, keys in self._pending_endpoints.items()}
            return len(self._pending_services), Counter(families)

    def has_pending(self) -> bool:
        with self._lock:
            return bool(self._pending_services or self._pending_endpoints)

    def _set_service(self, key: ServiceKey, obj: Obj | None) -> frozenset[int]:
        """The IP families the change touches; none when nothing changed."""
        ports: list[ServicePort] = []
        if obj is not None and not ignored(obj):
            ports = parse_or_skip(parse_service, obj, "Service") or []
        old = self._services.get(key, [])
        if old == ports:
            return frozenset()
        if ports:
            self._services[key] = ports
        else:
            self._services.pop(key, None)
        self._pending_services.add(key)
        self._service_events += 1
        return _cluster_ip_families(old) | _cluster_ip_families(ports)

    def _set_slice(self, slice_key: tuple[str, str], obj: Obj | None) -> frozenset[int]:
        """The IP families the change touches; none when nothing changed."""
        parsed: EndpointSlice | None = None
        if obj is not None and not ignored(obj):
            parsed = parse_or_skip(parse_endpoint_slice, obj, "EndpointSlice")
        old_owner = self._slice_owner.pop(slice_key, None)
        old: EndpointSlice | None = None
        if old_owner is not None:
            old = self._slices[old_owner].pop(slice_key[1], None)
            if not self._slices[old_owner]:
                del self._slices[old_owner]
        if parsed is not None:
            key = (parsed.namespace, parsed.service)
            self._slice_owner[slice_key] = key
            self._slices.setdefault(key, {})[parsed.name] = parsed
        if old == parsed:
            return frozenset()
        changed = {old_owner} if old_owner is not None else set()
        if parsed is not None:
            changed.add((parsed.namespace, parsed.service))
        families = frozenset(s.family for s in (old, parsed) if s is not None)
        for key in changed:
            for family in families:
                self._pending_endpoints.setdefault(family, set()).add(key)
        self._endpoint_events += 1
        at = _trigger_time(obj) if obj is not None and parsed is not None else None
        if parsed is not None and at is not None and at > self._started:
            timed = (parsed.family, (parsed.namespace, parsed.service))
            self._trigger_times[timed] = min(self._trigger_times.get(timed, at), at)
        return families

    def _notify(self, families: frozenset[int]) -> None:
        if families:
            self._on_change(families)

    def service_event(self, kind: str, obj: Obj) -> None:
        with self._lock:
            families = self._set_service(key_of(obj), None if kind == "DELETED" else obj)
        self._notify(families)

    def slice_event(self, kind: str, obj: Obj) -> None:
        with self._lock:
            families = self._set_slice(key_of(obj), None if kind == "DELETED" else obj)
        self._notify(families)

    def replace_services(self, objs: list[Obj]) -> None:
        """A fresh list: services missing from it are gone."""
        with self._lock:
            present = {key_of(obj): obj for obj in objs}
            families: set[int] = set()
            for key in list(self._services.keys() - present.keys()):
                families |= self._set_service(key, None)
            for key, obj in present.items():
                families |= self._set_service(key, obj)
            self._listed.add("services")
        self._on_change(frozenset(families))

    def replace_slices(self, objs: list[Obj]) -> None:
        with self._lock:
            present = {key_of(obj): obj for obj in objs}
            families: set[int] = set()
            for slice_key in list(self._slice_owner.keys() - present.keys()):
                families |= self._set_slice(slice_key, None)
            for slice_key, obj in present.items():
                families |= self._set_slice(slice_key, obj)
            self._listed.add("endpointslices")
        self._on_change(frozenset(families))

    def node_event(self, kind: str, obj: Obj) -> None:
        with self._lock:
            node = (
                NodeInfo(self.node.name)
                if kind == "DELETED"
                else parse_or_skip(parse_node, obj, "Node") or self.node
            )
            families = frozenset(IP_FAMILIES) if node != self.node else frozenset()
            self.node = node
        self._notify(families)

    def _set_service_cidr(self, name: str, obj: Obj | None) -> frozenset[int]:
        """The IP families whose ranges changed."""
        old = self._service_cidrs.pop(name, ())
        new = parse_or_skip(parse_service_cidr, obj, "ServiceCIDR") if obj is not None else None
        if new:
            self._service_cidrs[name] = new
        return frozenset(family_of(cidr) for cidr in set(old) ^ set(new or ()))

    def service_cidr_event(self, kind: str, obj: Obj) -> None:
        with self._lock:
            families = self._set_service_cidr(key_of(obj)[1], None if kind == "DELETED" else obj)
        self._notify(families)

    def replace_service_cidrs(self, objs: list[Obj]) -> None:
        with self._lock:
            present = {key_of(obj)[1]: obj for obj in objs}
            families: set[int] = set()
            for name in list(self._service_cidrs.keys() - present.keys()):
                families |= self._set_service_cidr(name, None)
            for name, obj in present.items():
                families |= self._set_service_cidr(name, obj)
        self._notify(frozenset(families))

    # ------------------------------------------------------------ taking
    def _view(self, key: ServiceKey) -> ServiceView:
        ports = self._services.get(key, [])
        slices = list(self._slices.get(key, {}).values())
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
                service_cidrs=tuple(sorted({c for cs in self._service_cidrs.values() for c in cs})),
                trigger_times=trigger_times,
                service_changes=self._service_events,
                endpoint_changes=self._endpoint_events,
            )
            self._pending_services.clear()
            self._pending_endpoints.clear()
            self._service_events = self._endpoint_events = 0
            self._trigger_times.clear()
            return changes
