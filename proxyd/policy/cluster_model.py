"""ClusterNetworkPolicy (policy.networking.k8s.io/v1alpha2, sigs.k8s.io/network-policy-api
v0.2.0) parsed from API objects into what enforcement depends on.

A cluster policy belongs to the Admin tier (judged before NetworkPolicy) or the Baseline tier
(judged only for pods no NetworkPolicy isolates); within a tier, a lower priority is judged
first, and within a policy the rules in the order written. A rule's action is Accept, Deny or
Pass (skip the tier's remaining rules).

The API says how to fail closed on a peer an implementation cannot use: an Accept rule does
not match through it, a Deny or Pass rule becomes "deny all". knit applies the same to every
peer or protocol entry it cannot read or does not implement (the experimental `nodes` and
`domainNames` peers), and records each case in the policy's `problems`, which the caller logs.
A policy whose tier, priority or subject cannot be read is left out whole, with its problem:
its subject is unknown, and denying the whole cluster's traffic would be worse than what the
API server's own validation of those fields already prevents. The staged annotation is read
as a NetworkPolicy's is (model.staged_of).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from proxyd.model import PROTOCOLS, InvalidObject, Obj
from proxyd.policy.model import (
    EGRESS,
    EVERYTHING,
    INGRESS,
    IpBlock,
    Peer,
    PortMatch,
    mapping,
    network,
    parse_selector,
    sequence,
    staged_of,
)

ADMIN = "Admin"
BASELINE = "Baseline"
TIERS = (ADMIN, BASELINE)
ACCEPT = "Accept"
DENY = "Deny"
PASS = "Pass"
ACTIONS = (ACCEPT, DENY, PASS)
UNSUPPORTED_PEERS = ("nodes", "domainNames")


@dataclass(frozen=True, slots=True)
class ClusterRule:
    """One rule: `peers` None means any peer, `ports` None any port of any protocol."""

    action: str
    peers: tuple[Peer, ...] | None
    ports: tuple[PortMatch, ...] | None
    name: str = ""
    index: int = field(default=0, compare=False)
    """Its position in the object's rules of its direction, as `kubectl knit explain` names
    it; not part of what it matches."""


DENY_ALL = ClusterRule(DENY, None, None)


@dataclass(frozen=True, slots=True)
class ClusterNetworkPolicy:
    name: str
    tier: str
    priority: int
    subject: Peer
    """The pods it applies to: pod and namespace selectors, both always set."""
    ingress: tuple[ClusterRule, ...] = ()
    egress: tuple[ClusterRule, ...] = ()
    problems: tuple[str, ...] = field(default=(), compare=False)
    staged: bool = False
    """Annotated as staged: compiled only into the staged view, never enforced."""

    def rules(self, direction: str) -> tuple[ClusterRule, ...]:
        return self.ingress if direction == INGRESS else self.egress


def _pods_peer(value: Any, what: str) -> Peer:
    spec = mapping(value, what)
    return Peer(
        pods=parse_selector(spec.get("podSelector"), f"{what}.podSelector"),
        namespaces=parse_selector(spec.get("namespaceSelector"), f"{what}.namespaceSelector"),
    )


def _one_field(spec: dict[str, Any], what: str) -> str:
    """The one field an API union sets."""
    present = [key for key, value in spec.items() if value is not None]
    if len(present) != 1:
        raise InvalidObject(f"{what} sets {present or 'nothing'} where exactly one field belongs")
    return present[0]


def _peers(value: Any, what: str, egress: bool) -> list[Peer]:
    spec = mapping(value, what)
    kind = _one_field(spec, what)
    if kind == "namespaces":
        return [Peer(pods=EVERYTHING, namespaces=parse_selector(spec[kind], f"{what}.namespaces"))]
    if kind == "pods":
        return [_pods_peer(spec[kind], f"{what}.pods")]
    if kind == "networks" and egress:
        cidrs = [network(text, f"{what}.networks") for text in sequence(spec[kind], "networks")]
        if not cidrs:
            raise InvalidObject(f"{what}.networks is empty")
        return [Peer(block=IpBlock(str(cidr))) for cidr in cidrs]
    if kind in UNSUPPORTED_PEERS and egress:
        raise InvalidObject(f"{what}.{kind} peers are not implemented")
    raise InvalidObject(f"{what} sets the unknown peer field {kind!r}")


def _port(value: Any, what: str) -> list[PortMatch]:
    spec = mapping(value, what)
    kind = _one_field(spec, what)
    if kind == "destinationNamedPort":
        name = spec[kind]
        if not isinstance(name, str) or not name:
            raise InvalidObject(f"{what}.destinationNamedPort {name!r} is not a port name")
        # a port name is unique within a pod, whatever its protocol
        return [PortMatch(protocol, name=name) for protocol in PROTOCOLS]
    protocol = kind.upper()
    if protocol not in PROTOCOLS:
        raise InvalidObject(f"{what} sets the unknown protocol field {kind!r}")
    port = mapping(mapping(spec[kind], f"{what}.{kind}").get("destinationPort"), "destinationPort")
    if not port:
        return [PortMatch(protocol)]
    shape = _one_field(port, f"{what}.{kind}.destinationPort")
    if shape == "number":
        first = last = port["number"]
    elif shape == "range":
        bounds = mapping(port["range"], "range")
        first, last = bounds.get("start"), bounds.get("end")
    else:
        raise InvalidObject(f"{what} destinationPort sets the unknown field {shape!r}")
    for number in (first, last):
        if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= 65535:
            raise InvalidObject(f"{what} port {number!r} is not a port number")
    if first > last:
        raise InvalidObject(f"{what} port range {first}-{last} is empty")
    return [PortMatch(protocol, first, last)]


def _rule(value: Any, key: str, index: int, problems: list[str]) -> ClusterRule | None:
    """The rule, narrowed as the API's fail-closed reading says; None when it matches nothing."""
    what = f"{key}[{index}]"
    spec = mapping(value, what)
    action = spec.get("action")
    if action not in ACTIONS:
        raise InvalidObject(f"{what} action {action!r} is not one of {ACTIONS}")
    name = spec["name"] if isinstance(spec.get("name"), str) else ""
    peers_key = "from" if key == "ingress" else "to"
    peers: list[Peer] = []
    unreadable = []
    entries = sequence(spec.get(peers_key), f"{what}.{peers_key}")
    for at, entry in enumerate(entries):
        try:
            peers += _peers(entry, f"{peers_key}[{at}]", key == "egress")
        except InvalidObject as err:
            unreadable.append(str(err))
    ports: list[PortMatch] | None = None
    try:
        if spec.get("protocols") is not None:
            ports = []
            for at, entry in enumerate(sequence(spec["protocols"], f"{what}.protocols")):
                ports += _port(entry, f"protocols[{at}]")
    except InvalidObject as err:
        unreadable.append(str(err))
        ports, peers = None, []
    if not entries:
        unreadable.append(f"no {peers_key} peer")
    verdict = "does not match through it" if action == ACCEPT else "now denies everything"
    label = f"{what} ({name})" if name else what
    problems += [f"{label}: {problem}; the {action} rule {verdict}" for problem in unreadable]
    if unreadable and action != ACCEPT:
        return replace(DENY_ALL, index=index)
    if not peers or (ports is not None and not ports):
        return None
    return ClusterRule(
        action, tuple(peers), tuple(ports) if ports is not None else None, name, index
    )


def parse_cluster_policy(obj: Obj) -> ClusterNetworkPolicy:
    """The policy; InvalidObject for one whose tier, priority or subject cannot be read."""
    meta = mapping(obj.get("metadata"), "metadata")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidObject("metadata has no name")
    staged, annotation_problems = staged_of(meta)
    spec = mapping(obj.get("spec"), "spec")
    tier, priority = spec.get("tier"), spec.get("priority")
    if tier not in TIERS:
        raise InvalidObject(f"tier {tier!r} is not one of {TIERS}")
    if isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 1000:
        raise InvalidObject(f"priority {priority!r} is not from 0 to 1000")
    subject_spec = mapping(spec.get("subject"), "subject")
    kind = _one_field(subject_spec, "subject")
    if kind == "namespaces":
        subject = Peer(EVERYTHING, parse_selector(subject_spec[kind], "subject.namespaces"))
    elif kind == "pods":
        subject = _pods_peer(subject_spec[kind], "subject.pods")
    else:
        raise InvalidObject(f"subject sets the unknown field {kind!r}")
    problems = list(annotation_problems)
    rules: dict[str, list[ClusterRule]] = {INGRESS: [], EGRESS: []}
    for direction, key in ((INGRESS, "ingress"), (EGRESS, "egress")):
        for index, entry in enumerate(sequence(spec.get(key), key)):
            try:
                rule = _rule(entry, key, index, problems)
            except InvalidObject as err:
                problems.append(f"{key}[{index}]: {err}; the rule now denies everything")
                rule = replace(DENY_ALL, index=index)
            if rule is not None:
                rules[direction].append(rule)
    return ClusterNetworkPolicy(
        name, tier, priority, subject, tuple(rules[INGRESS]), tuple(rules[EGRESS]),
        tuple(problems), staged,
    )  # fmt: skip
