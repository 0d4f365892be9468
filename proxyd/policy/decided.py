"""Pure: what decided a pod chain's verdict, in the API's terms (`decidedBy`), from a step of
the compiled table with provenance (verdict.Step): the one model `kubectl knit explain` and
the daemon's flow records (flows.py) both name rules with, its stable JSON (and back), and
what of it names the rule (rule_of: how staged.py and `explain --verify` compare two)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from proxyd.policy.compile import (
    ALLOW,
    CLUSTER_NETWORK_POLICY,
    DROP,
    NETWORK_POLICY,
    NETWORK_POLICY_TIER,
    NEXT,
    FamilyPolicy,
)
from proxyd.policy.verdict import Step

DEFAULT = "Default"
"""decidedBy.kind when no policy rule decided: the pod is not isolated."""
UNJUDGED = "Unjudged"
"""decidedBy.kind when no policy table judges the traffic at all."""
VERDICT_WORDS = {ALLOW: "allow", DROP: "drop", NEXT: "pass"}


@dataclass(frozen=True)
class DecidedBy:
    """What decided one direction: a policy rule (`kind` ClusterNetworkPolicy or
    NetworkPolicy, with its rule), the isolation of NetworkPolicies none of whose rules
    allows (NetworkPolicy, `rule` None), no policy at all (Default) or no table (Unjudged);
    `reason` says it in words."""

    kind: str
    reason: str
    namespace: str | None = None
    name: str | None = None
    tier: str | None = None
    priority: int | None = None
    rule: int | None = None
    rule_name: str | None = None
    action: str | None = None


def decided_by(step: Step, policy: FamilyPolicy, direction: str) -> DecidedBy:
    """What decided a step met on the chains of a pod (`step.chain` one of them) in the
    direction (`INGRESS` or `EGRESS`); `policy` compiled with provenance."""
    origin = step.origin
    if origin is not None:
        tier = origin.tier
        what = (
            f"{origin.kind} {origin.name}"
            if origin.kind == CLUSTER_NETWORK_POLICY
            else f"{origin.kind} {origin.namespace}/{origin.name}"
        )
        priority = "" if origin.priority is None else f", priority {origin.priority}"
        reason = (
            f"{what} ({tier} tier{priority}) {direction.lower()} rule {origin.rule}: "
            f"{origin.action}"
        )
        return DecidedBy(
            origin.kind,
            reason,
            origin.namespace or None,
            origin.name,
            tier,
            origin.priority,
            origin.rule,
            origin.rule_name or None,
            origin.action,
        )
    if step.verdict == DROP:
        first = policy.chains[step.chain].counter
        isolating = policy.isolated_by.get(first, ())
        owner = policy.owners[first]
        return DecidedBy(
            NETWORK_POLICY,
            f"isolated by NetworkPolicy {', '.join(isolating)}; no rule allows",
            owner[0],
            # several isolate alike: the direction's isolatedBy lists them
            isolating[0] if len(isolating) == 1 else None,
            NETWORK_POLICY_TIER,
        )
    return DecidedBy(
        DEFAULT,
        "not isolated by a NetworkPolicy, and no ClusterNetworkPolicy rule denies: allowed",
    )


RuleKey = tuple[str, str | None, str | None, str | None, int | None]


def rule_of(decided: DecidedBy) -> RuleKey:
    """What names the deciding rule, apart from the words that say it: kind, namespace, name,
    tier and rule index. A pod's isolation that no rule allows is one decision whichever
    NetworkPolicies isolate it, so its name is left out."""
    if decided.kind == NETWORK_POLICY and decided.rule is None:
        return decided.kind, decided.namespace, None, decided.tier, None
    return decided.kind, decided.namespace, decided.name, decided.tier, decided.rule


def from_json(shown: dict[str, Any]) -> DecidedBy:
    """A `decidedBy` as to_json wrote it (a field missing, as from an older daemon: None)."""
    return DecidedBy(
        str(shown["kind"]),
        str(shown.get("reason") or ""),
        shown.get("namespace"),
        shown.get("name"),
        shown.get("tier"),
        shown.get("priority"),
        shown.get("rule"),
        shown.get("ruleName"),
        shown.get("action"),
    )


def to_json(decided: DecidedBy) -> dict[str, Any]:
    return {
        "kind": decided.kind,
        "namespace": decided.namespace,
        "name": decided.name,
        "tier": decided.tier,
        "priority": decided.priority,
        "rule": decided.rule,
        "ruleName": decided.rule_name,
        "action": decided.action,
        "reason": decided.reason,
    }
