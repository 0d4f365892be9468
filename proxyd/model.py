"""The proxy's view of the cluster: Service ports and their endpoints, parsed from API objects.

Objects arrive as the API server's JSON (dicts with camelCase keys). Parsing validates what
the rules depend on; an object the proxy cannot use raises InvalidObject naming the problem,
and the caller logs and skips it. A bad entry of a list the object can do without (an
externalIP, a load balancer ingress IP, an endpoint) is logged and skipped alone, as
kube-proxy does; a bad loadBalancerSourceRange still skips the Service, since dropping the
range would open the load balancer to more clients than its owner allowed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NamedTuple, TypeVar

from cni import ip_text

PROTOCOLS = ("TCP", "UDP", "SCTP")
IGNORE_LABELS = ("service.kubernetes.io/service-proxy-name", "service.kubernetes.io/headless")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
TRIGGER_TIME_ANNOTATION = "endpoints.kubernetes.io/last-change-trigger-time"
ZONE_LABEL = "topology.kubernetes.io/zone"
DEFAULT_AFFINITY_TIMEOUT = 10800
TO_BE_DELETED_TAINT = "ToBeDeletedByClusterAutoscaler"

log = logging.getLogger(__name__)

Obj = dict[str, Any]
T = TypeVar("T")


class InvalidObject(ValueError):
    """An API object the proxy cannot program; the message says why."""


@dataclass(frozen=True, order=True, slots=True)
class ServicePortName:
    namespace: str
    name: str
    port: str
    protocol: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}:{self.port}"


@dataclass(frozen=True, slots=True)
class ServicePort:
    """One port of one Service, with everything its rules depend on."""

    name: ServicePortName
    cluster_ips: tuple[str, ...]
    port: int
    node_port: int = 0
    external_ips: tuple[str, ...] = ()
    load_balancer_ips: tuple[str, ...] = ()
    source_ranges: tuple[str, ...] = ()
    external_policy_local: bool = False
    internal_policy_local: bool = False
    affinity_timeout: int = 0
    health_check_node_port: int = 0

    @property
    def protocol(self) -> str:
        return self.name.protocol

    @property
    def externally_accessible(self) -> bool:
        return bool(self.node_port or self.external_ips or self.load_balancer_ips)

    @property
    def uses_cluster_endpoints(self) -> bool:
        """Cluster-IP traffic under the Cluster policy, and any externally reachable port:
        pods and the node itself reach its external frontends through every endpoint, even
        under an external Local policy."""
        return not self.internal_policy_local or self.externally_accessible

    @property
    def uses_local_endpoints(self) -> bool:
        return self.internal_policy_local or (
            self.externally_accessible and self.external_policy_local
        )


class Endpoint(NamedTuple):
    """One endpoint of a slice (its port 0) or of a service port. A tuple, not a frozen
    dataclass: every watch event of a slice makes one per endpoint and every sync of a changed
    service port one more, and a frozen dataclass's constructor sets each field through
    object.__setattr__ (4.4 us against the tuple's 1.0 us, timeit)."""

    ip: str
    port: int
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    node_name: str = ""
    zone: str = ""
    zone_hints: frozenset[str] = frozenset()
    node_hints: frozenset[str] = frozenset()

    def __str__(self) -> str:
        return f"[{self.ip}]:{self.port}" if family_of(self.ip) == 6 else f"{self.ip}:{self.port}"


@dataclass(frozen=True, slots=True)
class SlicePort:
    name: str
    port: int
    protocol: str


@dataclass(frozen=True, slots=True)
class EndpointSlice:
    namespace: str
    name: str
    service: str
    family: int
    ports: tuple[SlicePort, ...]
    endpoints: tuple[Endpoint, ...]
    trigger_time: float | None = field(default=None, compare=False)
    """Its last-change-trigger-time annotation, when readable: when the change it carries was
    made (kube-proxy's network programming latency). Not part of what the slice says: a slice
    differing only there is no change."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    zone: str = ""
    addresses: tuple[str, ...] = ()
    deleting: bool = False
    labels: dict[str, str] = field(default_factory=dict, compare=False)


def family_of(address: str) -> int:
    """The IP family (4 or 6) of an address or CIDR that was already validated."""
    return 6 if ":" in address else 4


def ignored(obj: Obj) -> bool:
    """Objects another proxy owns, or headless ones (kube-proxy's label selector)."""
    meta = obj.get("metadata")
    labels = meta.get("labels") if isinstance(meta, dict) else None
    return isinstance(labels, dict) and any(label in labels for label in IGNORE_LABELS)


def key_of(obj: Obj) -> tuple[str, str]:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return "", ""
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _named(obj: Obj) -> tuple[str, str]:
    namespace, name = key_of(obj)
    if not namespace or not name:
        raise InvalidObject("metadata has no namespace or name")
    return namespace, name


def parse_or_skip(parse: Callable[[Obj], T], obj: Obj, kind: str) -> T | None:
    """parse(obj); None, logged with the object's namespace and name, when the object cannot
    be used. InvalidObject says why; an object of another shape than the API's (a list where a
    map belongs) makes Python raise, and is skipped the same way, so that one bad object never
    stops a watch (its list would fail, and be retried, for ever)."""
    try:
        return parse(obj)
    except InvalidObject as err:
        reason = str(err)
    except (AttributeError, TypeError, KeyError, ValueError) as err:
        reason = f"not in the API's shape ({err!r})"
    log.warning("skipping %s %s: %s", kind, "/".join(filter(None, key_of(obj))), reason)
    return None


def _ip(text: Any, what: str) -> str:
    try:
        return ip_text.address_text(text)
    except ValueError as err:
        raise InvalidObject(f"{what} {text!r} is not an IP address") from err


def _usable_ip(value: Any, what: str, owner: str) -> str | None:
    """The address; None, logged, when value is not one."""
    try:
        return _ip(value, what)
    except InvalidObject as err:
        log.warning("%s: skipping %s", owner, err)
        return None


def _usable_ips(values: list[Any], what: str, owner: str) -> tuple[str, ...]:
    """The entries that are IP addresses; the others are logged and left out."""
    return tuple(ip for value in values if (ip := _usable_ip(value, what, owner)) is not None)


def _cidr(text: Any, what: str) -> str:
    try:
        return str(ip_text.network(text))
    except ValueError as err:
        raise InvalidObject(f"{what} {text!r} is not a CIDR") from err


def _port(value: Any, what: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidObject(f"{what} {value!r} is not a port number")
    if not (0 if allow_zero else 1) <= value <= 65535:
        raise InvalidObject(f"{what} {value} is out of range")
    return value


def _protocol(value: Any) -> str:
    protocol = value or "TCP"
    if protocol not in PROTOCOLS:
        raise InvalidObject(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    return protocol


def parse_service(obj: Obj) -> list[ServicePort]:
    """The ports the proxy programs for a Service; empty for headless and ExternalName."""
    namespace, name = _named(obj)
    spec = obj.get("spec") or {}
    if spec.get("type") == "ExternalName":
        return []
    cluster_ips = spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])
    if not cluster_ips or cluster_ips[0] == "None":
        return []
    cluster_ips = tuple(_ip(ip, "clusterIP") for ip in cluster_ips)
    owner = f"Service {namespace}/{name}"
    external_ips = _usable_ips(spec.get("externalIPs") or [], "externalIP", owner)
    ingress = ((obj.get("status") or {}).get("loadBalancer") or {}).get("ingress") or []
    lb_ips = _usable_ips(
        [
            entry["ip"]
            for entry in ingress
            if entry.get("ip") and entry.get("ipMode", "VIP") == "VIP"
        ],
        "load balancer ingress IP",
        owner,
    )
    source_ranges = tuple(
        _cidr(cidr, "loadBalancerSourceRange")
        for cidr in spec.get("loadBalancerSourceRanges") or []
    )
    affinity_timeout = 0
    if spec.get("sessionAffinity") == "ClientIP":
        config = (spec.get("sessionAffinityConfig") or {}).get("clientIP") or {}
        affinity_timeout = config.get("timeoutSeconds") or DEFAULT_AFFINITY_TIMEOUT
        if not isinstance(affinity_timeout, int) or not 0 < affinity_timeout <= 86400:
            raise InvalidObject(f"sessionAffinity timeoutSeconds {affinity_timeout!r} is invalid")
    external_local = spec.get("externalTrafficPolicy") == "Local"
    ports: list[ServicePort] = []
    seen: set[tuple[str, str]] = set()
    for entry in spec.get("ports") or []:
        port_name = ServicePortName(
            namespace, name, entry.get("name") or "", _protocol(entry.get("protocol"))
        )
        if (port_name.port, port_name.protocol) in seen:
            raise InvalidObject(f"port name {port_name.port!r} appears twice")
        seen.add((port_name.port, port_name.protocol))
        ports.append(
            ServicePort(
                name=port_name,
                cluster_ips=cluster_ips,
                port=_port(entry.get("port"), "port"),
                node_port=_port(entry.get("nodePort", 0), "nodePort", allow_zero=True),
                external_ips=external_ips,
                load_balancer_ips=lb_ips,
                source_ranges=source_ranges,
                external_policy_local=external_local,
                internal_policy_local=spec.get("internalTrafficPolicy") == "Local",
                affinity_timeout=affinity_timeout,
                health_check_node_port=(
                    _port(
                        spec.get("healthCheckNodePort", 0), "healthCheckNodePort", allow_zero=True
                    )
                    if external_local
                    else 0
                ),
            )
        )
    return ports


def parse_endpoint_slice(obj: Obj) -> EndpointSlice | None:
    """The slice's usable endpoints; None for FQDN slices and slices without a service."""
    namespace, name = _named(obj)
    labels = obj.get("metadata", {}).get("labels") or {}
    service = labels.get(SERVICE_NAME_LABEL)
    address_type = obj.get("addressType")
    if not service or address_type not in ("IPv4", "IPv6"):
        return None
    version = 4 if address_type == "IPv4" else 6
    owner = f"EndpointSlice {namespace}/{name}"
    ports = tuple(
        SlicePort(
            entry.get("name") or "",
            _port(entry.get("port"), "endpoint port"),
            _protocol(entry.get("protocol")),
        )
        for entry in obj.get("ports") or []
        if entry.get("port") is not None
    )
    endpoints: list[Endpoint] = []
    for entry in obj.get("endpoints") or []:
        addresses = entry.get("addresses") or []
        if not addresses:
            continue
        ip = _usable_ip(addresses[0], "endpoint address", owner)
        if ip is None:
            continue
        if family_of(ip) != version:
            log.warning("%s: skipping endpoint address %s: not %s", owner, ip, address_type)
            continue
        conditions = entry.get("conditions") or {}
        hints = entry.get("hints") or {}
        ready = conditions.get("ready")
        serving = conditions.get("serving")
        endpoints.append(
            Endpoint(
                ip=ip,
                port=0,
                ready=ready is not False,
                serving=serving is not False,
                terminating=bool(conditions.get("terminating")),
                node_name=entry.get("nodeName") or "",
                zone=entry.get("zone") or "",
                zone_hints=_hint_names(hints.get("forZones")),
                node_hints=_hint_names(hints.get("forNodes")),
            )
        )
    return EndpointSlice(
        namespace, name, service, version, ports, tuple(endpoints), _trigger_time(obj)
    )


def _trigger_time(obj: Obj) -> float | None:
    annotations = obj.get("metadata", {}).get("annotations") or {}
    stamp = annotations.get(TRIGGER_TIME_ANNOTATION)
    if not isinstance(stamp, str):
        return None
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


NO_HINTS: frozenset[str] = frozenset()


def _hint_names(hints: list[dict[str, Any]] | None) -> frozenset[str]:
    """The names of an endpoint's hints; the one shared empty set when it has none (each new
    empty frozenset is an object of its own, and two per endpoint added up:
    docs/benchmarks.md#beside-kube-proxy)."""
    return frozenset(hint.get("name", "") for hint in hints) if hints else NO_HINTS


def endpoints_for(port: ServicePort, slices: list[EndpointSlice]) -> tuple[Endpoint, ...]:
    """The endpoints of one service port: slice ports matched by name and protocol.

    When two slices hold the same address, the non-terminating entry wins.
    """
    chosen: dict[tuple[str, int], Endpoint] = {}
    for endpoint_slice in slices:
        for slice_port in endpoint_slice.ports:
            if slice_port.name != port.name.port or slice_port.protocol != port.protocol:
                continue
            for endpoint in endpoint_slice.endpoints:
                placed = endpoint._replace(port=slice_port.port)
                key = (placed.ip, placed.port)
                previous = chosen.get(key)
                if previous is None or (previous.terminating and not placed.terminating):
                    chosen[key] = placed
    return tuple(sorted(chosen.values(), key=lambda e: (e.ip, e.port)))


def parse_service_cidr(obj: Obj) -> tuple[str, ...]:
    """A ServiceCIDR's ranges (networking.k8s.io/v1 `spec.cidrs`), each validated."""
    cidrs = (obj.get("spec") or {}).get("cidrs") or []
    if not isinstance(cidrs, list):
        raise InvalidObject("spec.cidrs is not a list")
    return tuple(_cidr(cidr, "service CIDR") for cidr in cidrs)


def parse_node(obj: Obj) -> NodeInfo:
    """The node's addresses are its InternalIPs, then its ExternalIPs (so the first of a family
    is the node IP kube-proxy picks); it is being deleted once it has a deletionTimestamp or
    the cluster autoscaler's to-be-deleted taint."""
    meta = obj.get("metadata", {})
    labels = meta.get("labels") or {}
    listed = (obj.get("status") or {}).get("addresses") or []
    addresses = _usable_ips(
        [
            entry["address"]
            for kind in ("InternalIP", "ExternalIP")
            for entry in listed
            if entry.get("type") == kind and entry.get("address")
        ],
        "node address",
        f"Node {meta.get('name', '')}",
    )
    taints = (obj.get("spec") or {}).get("taints") or []
    return NodeInfo(
        name=meta.get("name", ""),
        zone=labels.get(ZONE_LABEL, ""),
        addresses=addresses,
        deleting=bool(meta.get("deletionTimestamp"))
        or any(taint.get("key") == TO_BE_DELETED_TAINT for taint in taints),
        labels=labels,
    )
