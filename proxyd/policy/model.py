"""The policy's view of the cluster: NetworkPolicies, Pods and Namespaces parsed from API
objects into what enforcement depends on.

A policy that cannot be understood must never allow more than its owner meant, so parsing
narrows rather than skips: a rule with a peer, port or selector it cannot read is left out
whole (dropping only the bad peer or port would leave an empty list, which means "any"), and
a policy whose pod selector or policy types cannot be read isolates every pod of its
namespace in both directions with no rule of its own. Each such narrowing is listed in the
policy's `problems`, which the caller logs with the policy's namespace and name.

A policy (or ClusterNetworkPolicy, cluster_model.py) annotated `knit.dev/staged: "true"` is
staged: parsed as any other, and marked so that the compiler leaves it out of what is
enforced (docs/observability.md#staged-policies). Only that exact value stages; an annotation
that cannot be read, or any other value, leaves the object enforced, with a problem when the
value is not "false": staging removes protection, so it is never read into an object.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cni import ip_text
from proxyd.model import PROTOCOLS, InvalidObject, Obj, family_of

INGRESS = "Ingress"
EGRESS = "Egress"
DIRECTIONS = (INGRESS, EGRESS)
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
TERMINAL_PHASES = ("Succeeded", "Failed")
STAGED_ANNOTATION = "knit.dev/staged"
"""The annotation that stages a policy: its matches are recorded, its verdicts not enforced."""
STAGED = "true"
NOT_STAGED = "false"
MAX_EXCEPT = 20_000
"""The most `except` entries knit takes in one ipBlock, few enough that one ipBlock's compile
stays short (docs/benchmarks.md#networkpolicy-make-bench-policy); the API server takes as many
as fit in an object (about 75,000)."""

Labels = Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: str
    values: tuple[str, ...] = ()
    """Sorted, so that equal selectors read the same (peer sets are named after them)."""

    def matches(self, labels: Labels) -> bool:
        if self.operator == "In":
            return labels.get(self.key) in self.values
        if self.operator == "NotIn":
            return labels.get(self.key) not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels


@dataclass(frozen=True, slots=True)
class Selector:
    """A label selector; no requirement selects everything."""

    requirements: tuple[Requirement, ...] = ()

    def matches(self, labels: Labels) -> bool:
        # a loop rather than all() over a generator: this runs once per candidate pod
        for requirement in self.requirements:  # noqa: SIM110
            if not requirement.matches(labels):
                return False
        return True


EVERYTHING = Selector()


@dataclass(frozen=True, slots=True)
class IpBlock:
    cidr: str
    excepted: tuple[str, ...] = ()

    @property
    def family(self) -> int:
        return family_of(self.cidr)


@dataclass(frozen=True, slots=True)
class Peer:
    """Pods (by namespace and pod selectors) or an address block. A pod peer without a
    namespace selector means the policy's own namespace."""

    pods: Selector | None = None
    namespaces: Selector | None = None
    block: IpBlock | None = None


@dataclass(frozen=True, slots=True)
class PortMatch:
    """A port by number (a range up to `end`), by name, or every port of the protocol."""

    protocol: str
    number: int | None = None
    end: int | None = None
    name: str = ""


@dataclass(frozen=True, slots=True)
class Rule:
    """One ingress or egress rule: peers None means any peer, ports None any port."""

    peers: tuple[Peer, ...] | None
    ports: tuple[PortMatch, ...] | None
    index: int = field(default=0, compare=False)
    """Its position in the object's rules of its direction (one left out as unreadable keeps
    its place), as `kubectl knit explain` names it; not part of what it matches."""


@dataclass(frozen=True, slots=True)
class NetworkPolicy:
    namespace: str
    name: str
    pods: Selector
    directions: frozenset[str]
    """The directions it isolates the pods it selects in."""
    ingress: tuple[Rule, ...] = ()
    egress: tuple[Rule, ...] = ()
    problems: tuple[str, ...] = field(default=(), compare=False)
    staged: bool = False
    """Annotated as staged: compiled only into the staged view, never enforced."""

    def rules(self, direction: str) -> tuple[Rule, ...]:
        return self.ingress if direction == INGRESS else self.egress


@dataclass(frozen=True, slots=True)
class Pod:
    namespace: str
    name: str
    labels: Labels
    node: str
    addresses: tuple[str, ...]
    numbers: tuple[int, ...]
    """The addresses as integers, in the same order."""
    named_ports: Mapping[tuple[str, str], int]
    """(name, protocol) -> container port."""
    by_family: Mapping[int, tuple[str, int]] = field(init=False, compare=False, repr=False)
    """IP family -> the pod's first address of it, as text and as a number (the compiler
    asks for it of every pod at each full compile)."""

    def __post_init__(self) -> None:
        by_family: dict[int, tuple[str, int]] = {}
        for text, number in zip(self.addresses, self.numbers, strict=True):
            by_family.setdefault(6 if ":" in text else 4, (text, number))
        object.__setattr__(self, "by_family", by_family)

    def port_named(self, name: str, protocol: str) -> int | None:
        return self.named_ports.get((name, protocol))


@dataclass(frozen=True, slots=True)
class Namespace:
    name: str
    labels: Labels


def mapping(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidObject(f"{what} is not an object")
    return value


def sequence(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise InvalidObject(f"{what} is not a list")
    return value


def _labels(value: Any, what: str) -> dict[str, str]:
    labels = mapping(value, what)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise InvalidObject(f"{what} holds a key or value that is not a string")
    return labels


def parse_selector(value: Any, what: str) -> Selector:
    spec = mapping(value, what)
    requirements = [
        Requirement(key, "In", (label,))
        for key, label in _labels(spec.get("matchLabels"), f"{what}.matchLabels").items()
    ]
    for expression in sequence(spec.get("matchExpressions"), f"{what}.matchExpressions"):
        expression = mapping(expression, f"{what}.matchExpressions[]")
        key, operator = expression.get("key"), expression.get("operator")
        values = sequence(expression.get("values"), f"{what} values")
        if not isinstance(key, str) or not key:
            raise InvalidObject(f"{what} has an expression without a key")
        if operator not in OPERATORS:
            raise InvalidObject(f"{what} operator {operator!r} is not one of {OPERATORS}")
        if not all(isinstance(v, str) for v in values):
            raise InvalidObject(f"{what} values for {key!r} are not all strings")
        if (operator in ("In", "NotIn")) != bool(values):
            raise InvalidObject(f"{what} operator {operator} for {key!r} has wrong values")
        requirements.append(Requirement(key, operator, tuple(sorted(set(values)))))
    return Selector(tuple(requirements))


def network(text: Any, what: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
    try:
        return ip_text.network(text)
    except ValueError as err:
        raise InvalidObject(f"{what} {text!r} is not a CIDR") from err


def _block(value: Any) -> IpBlock:
    spec = mapping(value, "ipBlock")
    cidr = network(spec.get("cidr"), "ipBlock cidr")
    excepted = []
    listed = sequence(spec.get("except"), "ipBlock except")
    if len(listed) > MAX_EXCEPT:
        # the rule is left out, so the block allows nothing rather than more than meant
        raise InvalidObject(f"ipBlock except has {len(listed)} entries, over knit's {MAX_EXCEPT}")
    for text in listed:
        carved = network(text, "ipBlock except")
        if carved.version != cidr.version or not carved.subnet_of(cidr):  # type: ignore[arg-type]
            raise InvalidObject(f"ipBlock except {text} is not inside {cidr}")
        excepted.append(str(carved))
    return IpBlock(str(cidr), tuple(excepted))


def _peer(value: Any) -> Peer:
    spec = mapping(value, "peer")
    if "ipBlock" in spec:
        if "podSelector" in spec or "namespaceSelector" in spec:
            raise InvalidObject("a peer holds an ipBlock and a selector")
        return Peer(block=_block(spec["ipBlock"]))
    if "podSelector" not in spec and "namespaceSelector" not in spec:
        raise InvalidObject("a peer names neither pods, namespaces nor an ipBlock")
    pods = parse_selector(spec.get("podSelector"), "podSelector")
    namespaces = (
        parse_selector(spec["namespaceSelector"], "namespaceSelector")
        if spec.get("namespaceSelector") is not None
        else None
    )
    return Peer(pods=pods, namespaces=namespaces)


def _port(value: Any) -> PortMatch:
    spec = mapping(value, "port")
    protocol = spec.get("protocol") or "TCP"
    if protocol not in PROTOCOLS:
        raise InvalidObject(f"protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    port, end = spec.get("port"), spec.get("endPort")
    if port is None:
        if end is not None:
            raise InvalidObject("endPort without a port")
        return PortMatch(protocol)
    if isinstance(port, str) and not port.isdigit():
        if end is not None:
            raise InvalidObject(f"endPort with the named port {port!r}")
        if not port:
            raise InvalidObject("an empty port name")
        return PortMatch(protocol, name=port)
    number = int(port) if isinstance(port, str) else port
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 65535:
        raise InvalidObject(f"port {port!r} is not a port number")
    if end is not None and (
        isinstance(end, bool) or not isinstance(end, int) or not number <= end <= 65535
    ):
        raise InvalidObject(f"endPort {end!r} is not a port from {number} to 65535")
    return PortMatch(protocol, number, end)


def _rule(value: Any, peers_key: str, index: int) -> Rule:
    spec = mapping(value, "rule")
    peers = sequence(spec.get(peers_key), peers_key)
    ports = sequence(spec.get("ports"), "ports")
    return Rule(
        tuple(_peer(peer) for peer in peers) if peers else None,
        tuple(_port(port) for port in ports) if ports else None,
        index,
    )


def _directions(spec: dict[str, Any]) -> frozenset[str]:
    types = spec.get("policyTypes")
    if types is None:
        return frozenset((INGRESS, EGRESS) if "egress" in spec else (INGRESS,))
    if not isinstance(types, list) or not all(t in DIRECTIONS for t in types):
        raise InvalidObject(f"policyTypes {types!r} are not among {DIRECTIONS}")
    # an empty list is the same as none given (the API server defaults it so)
    return frozenset(types) or frozenset((INGRESS, EGRESS) if "egress" in spec else (INGRESS,))


def staged_of(meta: dict[str, Any]) -> tuple[bool, tuple[str, ...]]:
    """Whether the object's metadata stages it, and the problem with its annotation if any.
    Never raises: an object must not be skipped (and its protection lost) for the sake of
    an annotation."""
    annotations = meta.get("annotations")
    if annotations is None:
        return False, ()
    if not isinstance(annotations, dict):
        return False, ("metadata.annotations is not an object: not staged, enforced",)
    value = annotations.get(STAGED_ANNOTATION)
    if value is None or value == NOT_STAGED:
        return False, ()
    if value == STAGED:
        return True, ()
    shown = repr(value) if isinstance(value, str) else f"a {type(value).__name__}"
    return False, (
        f"annotation {STAGED_ANNOTATION} is {shown[:80]}, not {STAGED!r}: not staged, enforced",
    )


def parse_policy(obj: Obj) -> NetworkPolicy:
    meta = mapping(obj.get("metadata"), "metadata")
    namespace, name = meta.get("namespace"), meta.get("name")
    if not isinstance(namespace, str) or not isinstance(name, str):
        raise InvalidObject("metadata has no namespace or name")
    staged, annotation_problems = staged_of(meta)
    spec = obj.get("spec")
    try:
        if not isinstance(spec, dict):
            raise InvalidObject("spec is not an object")
        pods = parse_selector(spec.get("podSelector"), "spec.podSelector")
        directions = _directions(spec)
    except InvalidObject as err:
        return NetworkPolicy(
            namespace,
            name,
            EVERYTHING,
            frozenset(DIRECTIONS),
            problems=(*annotation_problems, f"{err}: isolating every pod of the namespace"),
            staged=staged,
        )
    problems = list(annotation_problems)
    rules: dict[str, list[Rule]] = {INGRESS: [], EGRESS: []}
    for direction, key, peers_key in ((INGRESS, "ingress", "from"), (EGRESS, "egress", "to")):
        try:
            entries = sequence(spec.get(key), key)
        except InvalidObject as err:
            problems.append(f"{err}: no {key} rule applies")
            continue
        for index, entry in enumerate(entries):
            try:
                rules[direction].append(_rule(entry, peers_key, index))
            except InvalidObject as err:
                problems.append(f"{key}[{index}] left out: {err}")
    return NetworkPolicy(
        namespace, name, pods, directions, tuple(rules[INGRESS]), tuple(rules[EGRESS]),
        tuple(problems), staged,
    )  # fmt: skip


def _named_ports(spec: dict[str, Any]) -> dict[tuple[str, str], int]:
    ports: dict[tuple[str, str], int] = {}
    containers = sequence(spec.get("containers"), "containers")
    containers += sequence(spec.get("initContainers"), "initContainers")
    for container in containers:
        for port in sequence(mapping(container, "container").get("ports"), "ports"):
            port = mapping(port, "port")
            name, number = port.get("name"), port.get("containerPort")
            if isinstance(name, str) and name and isinstance(number, int):
                ports.setdefault((name, port.get("protocol") or "TCP"), number)
    return ports


def pod_essentials(obj: Obj) -> Obj:
    """The parts of a Pod object parse_pod reads; the rest (managedFields, most of the spec
    and status) is dropped as a list's pages arrive."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    if not isinstance(meta, dict) or not isinstance(spec, dict) or not isinstance(status, dict):
        return obj
    containers = {
        key: [{"ports": c.get("ports")} if isinstance(c, dict) else c for c in spec.get(key) or []]
        for key in ("containers", "initContainers")
        if isinstance(spec.get(key), list)
    }
    return {
        "metadata": {key: meta.get(key) for key in ("namespace", "name", "uid", "labels")},
        "spec": {
            "nodeName": spec.get("nodeName"),
            "hostNetwork": spec.get("hostNetwork"),
            **containers,
        },
        "status": {"phase": status.get("phase"), "podIPs": status.get("podIPs")},
    }


def parse_pod(obj: Obj, runtime_addresses: tuple[str, ...] = ()) -> Pod | None:
    """The pod as policies see it; None for pods that take no part (host network, finished,
    without an address yet). `runtime_addresses`: the addresses the runtime gave the pod's
    sandbox, taken until its status has some."""
    meta = mapping(obj.get("metadata"), "metadata")
    spec = mapping(obj.get("spec"), "spec")
    status = mapping(obj.get("status"), "status")
    if spec.get("hostNetwork") or status.get("phase") in TERMINAL_PHASES:
        return None
    addresses = []
    for entry in sequence(status.get("podIPs"), "status.podIPs"):
        text = mapping(entry, "podIPs[]").get("ip")
        try:
            addresses.append(ip_text.address(text))
        except ValueError as err:
            raise InvalidObject(f"pod IP {text!r} is not an address") from err
    if not addresses:
        addresses = [ip_text.address(text) for text in runtime_addresses]
    if not addresses:
        return None
    return Pod(
        meta.get("namespace") or "",
        meta.get("name") or "",
        _labels(meta.get("labels"), "labels"),
        spec.get("nodeName") or "",
        tuple(str(address) for address in addresses),
        tuple(int(address) for address in addresses),
        _named_ports(spec),
    )


def parse_namespace(obj: Obj) -> Namespace:
    meta = mapping(obj.get("metadata"), "metadata")
    return Namespace(meta.get("name") or "", _labels(meta.get("labels"), "labels"))
