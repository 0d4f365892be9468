"""A packet a pod chain logged (flowlog.Logged) resolved to a flow record: its ends, with
the pods at both where known, its verdict and the policy rule that decided it (`decidedBy`,
the model `kubectl knit explain` uses: decided.py), from the family's table as last written,
compiled with provenance (pure code); and the bounded ring the daemon keeps the records in.

A record is resolved by the table written when it is read, which a sync may have changed
since the packet was logged (a flush of NFLOG's batch, at most 0.1 s, plus the time to read
it): a rule index that no longer gives the logged verdict resolves to `Unknown`, never to
another rule.

With staged policies, the record also says what the staged view compiled with that table
(staged.py) makes of the connection, where that differs from what was enforced: the view's
chains judge the logged packet's addresses, protocol and port as the enforced ones did.
"""

from __future__ import annotations

import ipaddress
import itertools
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxyd.policy.compile import ALLOW, FamilyPolicy, PodKey
from proxyd.policy.decided import DecidedBy, decided_by
from proxyd.policy.decided import to_json as decided_json
from proxyd.policy.flowlog import ADDRESSES_KEPT, Logged
from proxyd.policy.model import EGRESS, INGRESS, Pod
from proxyd.policy.staged import changes
from proxyd.policy.verdict import Connection, Judge, Step

UNKNOWN = "Unknown"
"""decidedBy.kind when the table no longer holds the rule that logged the packet."""
QUARANTINED = "Quarantined"
"""decidedBy.kind of a pod whose rules nft refused: its chain drops everything."""
ALLOWED, DENIED = "allow", "deny"
RING_SIZE = 4096
"""Records a node keeps (Hubble keeps 4095 flows a node)."""


@dataclass(frozen=True)
class End:
    address: str
    port: int | None
    pod: PodKey | None


@dataclass(frozen=True)
class Staged:
    """What the staged policies would make of a recorded connection."""

    allowed: bool
    decided_by: DecidedBy

    @property
    def verdict(self) -> str:
        return ALLOWED if self.allowed else DENIED

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "decidedBy": decided_json(self.decided_by)}


@dataclass(frozen=True)
class FlowRecord:
    at: float
    node: str
    direction: str
    allowed: bool
    protocol: str
    source: End
    destination: End
    chain: str
    rule: int | None
    """The index of the deciding rule among the chain's compiled rules (None: its end)."""
    decided_by: DecidedBy
    staged: Staged | None = None
    """What the staged policies would make of it, where that differs from what was enforced
    (verdict or deciding rule); None otherwise."""

    @property
    def verdict(self) -> str:
        return ALLOWED if self.allowed else DENIED

    def to_json(self) -> dict[str, Any]:
        """The stable schema of docs/observability.md#flows."""
        return {
            "time": _rfc3339(self.at),
            "node": self.node,
            "direction": self.direction.lower(),
            "verdict": self.verdict,
            "protocol": self.protocol.upper(),
            "source": _end_json(self.source),
            "destination": _end_json(self.destination),
            "chain": self.chain,
            "rule": self.rule,
            "decidedBy": decided_json(self.decided_by),
            "staged": None if self.staged is None else self.staged.to_json(),
        }


def _rfc3339(at: float) -> str:
    whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at))
    return f"{whole}.{int(at % 1 * 1000):03d}Z"


def _end_json(end: End) -> dict[str, Any]:
    pod = None if end.pod is None else {"namespace": end.pod[0], "name": end.pod[1]}
    return {"address": end.address, "port": end.port, "pod": pod}


class PodIndex:
    """The pods by address of one snapshot of the cluster, made when a record first asks
    for a new snapshot (never by the sync, which would pay for it at every change); and the
    pod of each address text a record asked for, up to ADDRESSES_KEPT of them (a node's
    records name the same few addresses over and over, and ipaddress takes microseconds)."""

    def __init__(self) -> None:
        self._pods: Mapping[PodKey, Pod] | None = None
        self._by_address: dict[int, PodKey] = {}
        self._by_text: dict[str, PodKey | None] = {}

    def at(self, pods: Mapping[PodKey, Pod], address: str) -> PodKey | None:
        if pods is not self._pods:
            self._pods = pods
            self._by_address = {n: key for key, pod in pods.items() for n in pod.numbers}
            self._by_text = {}
        if address in self._by_text:
            return self._by_text[address]
        if len(self._by_text) >= ADDRESSES_KEPT:
            self._by_text.clear()
        found = self._by_text[address] = self._by_address.get(int(ipaddress.ip_address(address)))
        return found


class ViewJudge:
    """The Judge of the last staged view a record asked for, made anew only for a new view
    (its peer sets are indexed as rules ask for them)."""

    def __init__(self) -> None:
        self._judge: Judge | None = None

    def of(self, view: FamilyPolicy) -> Judge:
        if self._judge is None or self._judge.policy is not view:
            self._judge = Judge(view)
        return self._judge


def direction_of(chain: str) -> str:
    """A pod chain's direction, from its name (compile.chain_name)."""
    return INGRESS if chain.startswith("ingress") else EGRESS


def decided(logged: Logged, policy: FamilyPolicy | None) -> DecidedBy:
    """What decided the logged verdict, by the table as written now."""
    pod_chain = None if policy is None else policy.chains.get(logged.chain)
    if policy is None or pod_chain is None:
        return DecidedBy(UNKNOWN, "the pod's chain has left the table since")
    if pod_chain.counter in policy.quarantined:
        return DecidedBy(QUARANTINED, "nft refused the pod's rules: its chain drops everything")
    if logged.index is None:
        verdict, origin = pod_chain.otherwise, None
    elif logged.index < len(pod_chain.matches):
        match = pod_chain.matches[logged.index]
        verdict, origin = match.verdict, match.origin
    else:
        verdict, origin = "", None
    if verdict != logged.verdict:
        return DecidedBy(UNKNOWN, "the pod's rules have changed since")
    step = Step(logged.chain, logged.index, verdict, origin)
    return decided_by(step, policy, direction_of(logged.chain))


def staged_decision(
    logged: Logged, enforced: DecidedBy, view: FamilyPolicy, judges: ViewJudge
) -> Staged | None:
    """What the staged view makes of the logged connection, where that differs from what
    decided it (`enforced`); None when it does not, or when the record's rule is not known."""
    if enforced.kind in (UNKNOWN, QUARANTINED):
        return None
    direction = direction_of(logged.chain)
    connection = Connection(logged.source, logged.destination, logged.protocol, logged.port or 0)
    decision = judges.of(view).decide(direction, connection)
    if decision is None:
        return None
    would = Staged(decision.allowed, decided_by(decision.decided_by, view, direction))
    was = (logged.verdict == ALLOW, enforced)
    return would if changes(was, (would.allowed, would.decided_by)) else None


def resolve(
    logged: Logged,
    node: str,
    policy: FamilyPolicy | None,
    pods: Mapping[PodKey, Pod],
    index: PodIndex,
    view: tuple[FamilyPolicy, ViewJudge] | None = None,
) -> FlowRecord:
    """The record of a logged packet; `policy` and `pods`: the family's table as last
    written and the cluster it was compiled from; `view`: the staged view compiled with that
    table, when a policy is staged, and its judge."""
    direction = direction_of(logged.chain)
    owner = None
    if policy is not None and (pod_chain := policy.chains.get(logged.chain)) is not None:
        owner = policy.owners.get(pod_chain.counter)
    source = index.at(pods, logged.source) or (owner if direction == EGRESS else None)
    destination = index.at(pods, logged.destination) or (owner if direction == INGRESS else None)
    enforced = decided(logged, policy)
    return FlowRecord(
        logged.at,
        node,
        direction,
        logged.verdict == ALLOW,
        logged.protocol,
        End(logged.source, logged.source_port, source),
        End(logged.destination, logged.port, destination),
        logged.chain,
        logged.index,
        enforced,
        None if view is None else staged_decision(logged, enforced, *view),
    )


class Ring:
    """The last `size` records (as JSON), each numbered, for readers that follow: a reader
    gives the number of the last it read and gets the ones after it still held."""

    def __init__(self, size: int = RING_SIZE) -> None:
        self._items: deque[dict[str, Any]] = deque(maxlen=size)
        self._next = 0
        """The number the next record gets."""
        self._changed = threading.Condition()

    def add(self, item: dict[str, Any]) -> None:
        with self._changed:
            self._items.append(item)
            self._next += 1
            self._changed.notify_all()

    def after(self, last: int, wait: float = 0.0) -> tuple[list[dict[str, Any]], int]:
        """The records after number `last` (-1: all held), waiting up to `wait` seconds for
        one; and the number of the last record now."""
        with self._changed:
            if wait and self._next <= last + 1:
                self._changed.wait(wait)
            first = self._next - len(self._items)
            start = max(0, last + 1 - first)
            return list(itertools.islice(self._items, start, None)), self._next - 1
