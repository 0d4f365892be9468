"""Pure: what `kubectl knit explain --verify` probes, and whether the answers agree.

An explanation says, for each connection a new connection may become (one per eligible
endpoint, after the DNAT), whether the policies let it through. The probes ask the kernel
the same from the source pod itself (proxyd/explain/probe.py runs them):

- each endpoint's connection, to the endpoint's address and port directly: the policies judge
  it as they judge the DNAT'd one, since they see the connection after the DNAT. Not where the
  proxy masquerades it: a direct connection keeps the pod's address, which the ingress
  policies would judge instead of the node's;
- the Service's frontend, when every endpoint's connection has the same verdict (otherwise the
  proxy's choice of endpoint decides, and no single answer is expected); with no eligible
  endpoint, the frontend must not connect.

A probe that connects, or that the destination refuses (a TCP reset or an ICMP port
unreachable: the packet got there, and nothing listens), was let through; one that times
out was not: knit's policies drop what they deny.

Then the deciding rule, where the daemons keep flow records (proxyd/policy/flows.py): each
endpoint probe's records, egress from the source's node and ingress from the destination's,
are those of the source pod to the probe's address, port and protocol read since the probes
began. Each record's enforced verdict and `decidedBy` (never its `staged` one) must be the
explanation's for that direction; a record whose rule changed before the daemon read it
(`Unknown`) says nothing. A direction no pod chain judges (no policy selects the pod there,
traffic that is never judged, an ingress its egress drops) leaves no record, and the
records of a Service frontend's probe are those of the endpoint the proxy picked, whose own
probe checks them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from proxyd.explain.explain import Explanation, Judgement, Leg
from proxyd.policy.decided import UNJUDGED, from_json, rule_of
from proxyd.policy.flows import ALLOWED, DENIED, UNKNOWN

CONNECTED = "connected"
REFUSED = "refused"
TIMED_OUT = "timed out"
DELIVERED = (CONNECTED, REFUSED)
AGREES = "agrees"
DISAGREES = "disagrees"
INCONCLUSIVE = "inconclusive"
NOT_CHECKED = "not checked"


@dataclass(frozen=True)
class Probe:
    address: str
    port: int
    protocol: str
    target: str
    """What the address is, for the reader: an endpoint's pod, or the Service."""
    expected: bool
    """Whether the connection should get through."""
    leg: Leg | None = None
    """The connection it makes, as explained; None for a Service's frontend (the proxy picks
    the endpoint)."""


@dataclass(frozen=True)
class Records:
    """The flow records read after the probes: the source pod's, from the nodes whose
    directions the probes' connections cross."""

    since: float
    """When the probes began (seconds since the epoch): older records are of other
    connections."""
    found: tuple[dict[str, Any], ...]
    unread: Mapping[str, str] = field(default_factory=dict)
    """Node -> why its records could not be read."""


@dataclass(frozen=True)
class RuleCheck:
    """One direction of a probe's connection: the explanation's decision against the
    records of the node that judges it."""

    expected: Judgement
    judgement: str
    """AGREES, DISAGREES or NOT_CHECKED."""
    records: int = 0
    """The records compared."""
    recorded: dict[str, Any] | None = None
    """The record shown: the first that disagrees, else the last compared."""
    why: str = ""
    """Why it was not checked."""
    unrecorded: bool = False
    """Not checked because nothing judges the direction, so nothing is recorded: the
    absence of a record is what the explanation says."""


@dataclass(frozen=True)
class Answer:
    probe: Probe
    outcome: str
    """CONNECTED, REFUSED, TIMED_OUT, or the probe's own error."""
    rules: tuple[RuleCheck, ...] = ()
    """Egress, then ingress, when the probe has a connection explained."""

    @property
    def judgement(self) -> str:
        """AGREES, DISAGREES, or INCONCLUSIVE (the probe itself failed: no container, no
        agnhost, an address it cannot use)."""
        if self.outcome not in (*DELIVERED, TIMED_OUT):
            return INCONCLUSIVE
        return AGREES if (self.outcome in DELIVERED) == self.probe.expected else DISAGREES

    @property
    def rule(self) -> str:
        """DISAGREES when a direction's records do; AGREES when one direction's agree and the
        other's agree too or are rightly absent; else NOT_CHECKED."""
        judgements = [check.judgement for check in self.rules]
        if DISAGREES in judgements:
            return DISAGREES
        missing = [c for c in self.rules if c.judgement == NOT_CHECKED and not c.unrecorded]
        return AGREES if AGREES in judgements and not missing else NOT_CHECKED


@dataclass(frozen=True)
class Verification:
    pod: str
    """The source pod's ephemeral container that probed."""
    answers: tuple[Answer, ...]
    skipped: tuple[str, ...]
    """Connections not probed, and why."""

    @property
    def agrees(self) -> bool:
        """Every probe's verdict agrees, and no deciding rule recorded disagrees."""
        return all(
            answer.judgement == AGREES and answer.rule != DISAGREES for answer in self.answers
        )


def probes(explanation: Explanation) -> tuple[list[Probe], list[str]]:
    """The probes that test the explanation, and the connections left unprobed with why."""
    found: list[Probe] = []
    skipped: list[str] = []
    protocol = explanation.protocol
    for leg in explanation.legs:
        target = "/".join(leg.pod) if leg.pod else "not a pod"
        if leg.masquerade:
            skipped.append(
                f"{leg.address}:{leg.port}: masqueraded by the proxy, which a direct "
                "connection is not"
            )
            continue
        found.append(Probe(leg.address, leg.port, protocol, target, leg.allowed, leg))
    service = explanation.service
    if service is None:
        return found, skipped
    frontend = f"Service {service.namespace}/{service.name}"
    verdicts = {leg.allowed for leg in explanation.legs}
    if len(verdicts) > 1:
        skipped.append(
            f"{service.address}:{service.port}: its endpoints' verdicts differ, so the "
            "proxy's choice decides"
        )
    else:
        expected = verdicts.pop() if verdicts else False
        found.append(Probe(service.address, service.port, protocol, frontend, expected))
    return found, skipped


def judging_nodes(probes: list[Probe]) -> set[str]:
    """The nodes whose records the probes' connections may leave."""
    return {
        judgement.node
        for probe in probes
        if probe.leg is not None
        for judgement in (probe.leg.egress, probe.leg.ingress)
        if judgement.node is not None
    }


def checked(explanation: Explanation, answer: Answer, records: Records) -> Answer:
    """The answer with each direction of its connection checked against the records."""
    leg = answer.probe.leg
    if leg is None:
        return answer
    rules = tuple(
        _check(explanation, answer.probe, judgement, records)
        for judgement in (leg.egress, leg.ingress)
    )
    return dataclasses.replace(answer, rules=rules)


def _check(
    explanation: Explanation, probe: Probe, expected: Judgement, records: Records
) -> RuleCheck:
    mine = [r for r in records.found if _of(r, explanation, probe, expected, records.since)]
    known = [r for r in mine if r["decidedBy"]["kind"] != UNKNOWN]
    if known:
        disagreeing = [r for r in known if not _agrees(r, expected)]
        judgement = DISAGREES if disagreeing else AGREES
        shown = disagreeing[0] if disagreeing else known[-1]
        return RuleCheck(expected, judgement, len(known), shown)
    silent = _unrecorded(expected)
    if silent:
        return RuleCheck(expected, NOT_CHECKED, why=silent, unrecorded=True)
    node = expected.node
    if node is not None and node in records.unread:
        return RuleCheck(expected, NOT_CHECKED, why=f"{node}'s records: {records.unread[node]}")
    if mine:
        return RuleCheck(
            expected, NOT_CHECKED, why="its records' rule changed before the daemon read them"
        )
    return RuleCheck(
        expected,
        NOT_CHECKED,
        why=f"no record on {node} (over --flow-records-rate then, or gone from its ring)",
    )


def _of(
    record: dict[str, Any],
    explanation: Explanation,
    probe: Probe,
    expected: Judgement,
    since: float,
) -> bool:
    """Whether the record is of the probe's connection, in the expected direction on the
    node that judges it, since the probes began."""
    source, destination = record["source"], record["destination"]
    pod = source["pod"]
    return (
        record["node"] == expected.node
        and record["direction"] == expected.direction.lower()
        and record["protocol"] == probe.protocol.upper()
        and pod is not None
        and (pod["namespace"], pod["name"]) == explanation.source
        and _address(destination["address"]) == _address(probe.address)
        and destination["port"] == probe.port
        and _milliseconds(record["time"]) >= int(since * 1000)
    )


def _agrees(record: dict[str, Any], expected: Judgement) -> bool:
    """The record's enforced verdict and deciding rule are the explanation's."""
    verdict = ALLOWED if expected.allowed else DENIED
    recorded = from_json(record["decidedBy"])
    return record["verdict"] == verdict and rule_of(recorded) == rule_of(expected.decided_by)


def _unrecorded(expected: Judgement) -> str:
    """Why nothing records the direction, as explained; empty when a pod chain judges it."""
    if not expected.reached:
        return "egress drops it first, so nothing is recorded"
    if expected.decided_by.kind == UNJUDGED or not expected.path:
        return f"no pod chain judges it, so nothing is recorded ({expected.decided_by.reason})"
    return ""


def _address(text: str) -> str:
    return str(ipaddress.ip_address(text))


def _milliseconds(text: str) -> int:
    """A record's time (RFC 3339 in UTC, with milliseconds) in milliseconds since the epoch."""
    return round(datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000)
