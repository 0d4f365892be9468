"""Pure: an Explanation as JSON (the stable schema of docs/observability.md) and as text."""

from __future__ import annotations

from collections import Counter
from typing import Any

from proxyd.explain.explain import Explanation, Judgement, Leg, StagedLeg
from proxyd.explain.verify import AGREES, DISAGREES, Answer, RuleCheck, Verification
from proxyd.model import family_of
from proxyd.policy.compile import PodKey
from proxyd.policy.decided import to_json as decided_json

ALLOWED = "allow"
DENIED = "deny"


def _verdict(allowed: bool) -> str:
    return ALLOWED if allowed else DENIED


def _pod(key: PodKey | None) -> dict[str, str] | None:
    return None if key is None else {"namespace": key[0], "name": key[1]}


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if family_of(address) == 6 else f"{address}:{port}"


def _judgement(judgement: Judgement) -> dict[str, Any]:
    return {
        "verdict": _verdict(judgement.allowed),
        "reached": judgement.reached,
        "node": judgement.node,
        "pod": _pod(judgement.pod),
        "judgedBy": list(judgement.judged_by),
        "isolatedBy": list(judgement.isolated_by),
        "decidedBy": decided_json(judgement.decided_by),
        "path": [
            {
                "chain": hop.chain,
                "rule": hop.index,
                "verdict": hop.verdict,
                "decidedBy": decided_json(hop.decided_by),
            }
            for hop in judgement.path
        ],
    }


def _staged(staged: StagedLeg | None, would_allow: bool) -> dict[str, Any] | None:
    if staged is None:
        return None
    return {
        "verdict": _verdict(would_allow),
        "changed": [direction.lower() for direction in staged.changed],
        "egress": _judgement(staged.egress),
        "ingress": _judgement(staged.ingress),
    }


def _leg(explanation: Explanation, leg: Leg) -> dict[str, Any]:
    dnat = None
    if explanation.service is not None:
        dnat = {
            "from": _endpoint(explanation.address, explanation.port),
            "to": _endpoint(leg.address, leg.port),
        }
    return {
        "verdict": _verdict(leg.allowed),
        "address": leg.address,
        "port": leg.port,
        "pod": _pod(leg.pod),
        "node": leg.node,
        "dnat": dnat,
        "masquerade": leg.masquerade,
        "masqueradeReason": leg.masquerade_reason or None,
        "egress": _judgement(leg.egress),
        "ingress": _judgement(leg.ingress),
        "staged": _staged(leg.staged, leg.would_allow),
    }


def to_json(explanation: Explanation) -> dict[str, Any]:
    """The schema of docs/observability.md: `egress` and `ingress` are those of the
    connection shown (the first denied, else the first; None when no connection is made),
    `connections` has every endpoint explained; `staged` is None unless staged policies
    change a connection's verdict or deciding rule, else the verdict with them enforced and
    the directions of the connection they change shown first (the first they deny)."""
    service = explanation.service
    shown = explanation.shown
    return {
        "verdict": _verdict(explanation.allowed),
        "protocol": explanation.protocol,
        "source": {
            "namespace": explanation.source[0],
            "name": explanation.source[1],
            "node": explanation.source_node,
            "address": explanation.source_address,
        },
        "destination": {
            "kind": explanation.destination,
            "address": explanation.address,
            "port": explanation.port,
            "pod": _pod(explanation.destination_pod),
        },
        "service": None
        if service is None
        else {
            "namespace": service.namespace,
            "name": service.name,
            "type": service.type,
            "port": service.port,
            "portName": service.port_name,
            "frontend": service.frontend,
            "address": service.address,
            "internalTrafficPolicy": service.internal_traffic_policy,
            "externalTrafficPolicy": service.external_traffic_policy,
            "endpoints": [
                {
                    "address": choice.address,
                    "port": choice.port,
                    "node": choice.node or None,
                    "pod": _pod(choice.pod),
                    "eligible": choice.eligible,
                    "reason": choice.reason,
                }
                for choice in service.endpoints
            ],
            "noEndpoint": service.no_endpoint,
        },
        "egress": None if shown is None else _judgement(shown.egress),
        "ingress": None if shown is None else _judgement(shown.ingress),
        "connections": [_leg(explanation, leg) for leg in explanation.legs],
        "notes": list(explanation.notes),
        "staged": _staged(explanation.staged_shown, explanation.would_allow),
    }


def _direction_lines(judgement: Judgement) -> list[str]:
    where = f"on {judgement.node}" if judgement.node else ""
    pod = f" ({'/'.join(judgement.pod)})" if judgement.pod else ""
    reached = "" if judgement.reached else " [not reached: egress drops it; would be]"
    head = f"  {judgement.direction.lower():<7} {where}{pod}:{reached} "
    lines = [head + f"{_verdict(judgement.allowed)}: {judgement.decided_by.reason}"]
    if judgement.judged_by:
        lines.append(f"          judged by: {', '.join(judgement.judged_by)}")
    for hop in judgement.path:
        at = "end" if hop.index is None else f"rule {hop.index}"
        lines.append(f"          {hop.chain} {at}: {hop.verdict} ({hop.decided_by.reason})")
    return lines


def _staged_line(staged: StagedLeg) -> str:
    """`staged: would deny (ingress: what would decide)`, for the directions it changes."""
    changed = {judgement.direction: judgement for judgement in (staged.egress, staged.ingress)}
    reasons = "; ".join(
        f"{direction.lower()}: {changed[direction].decided_by.reason}"
        for direction in staged.changed
    )
    return f"  staged: would {_verdict(staged.allowed)} ({reasons})"


def to_text(explanation: Explanation) -> str:
    source = "/".join(explanation.source)
    lines = [
        f"from     {source} {explanation.source_address} on node {explanation.source_node}",
    ]
    target = _endpoint(explanation.address, explanation.port)
    service = explanation.service
    if service is not None:
        lines += [
            f"to       Service {service.namespace}/{service.name} port {service.port}"
            f"{f' ({service.port_name})' if service.port_name else ''} {explanation.protocol}, "
            f"{service.frontend} {service.address}",
            f"         type {service.type}, internalTrafficPolicy "
            f"{service.internal_traffic_policy}, externalTrafficPolicy "
            f"{service.external_traffic_policy}",
            f"         endpoints from node {explanation.source_node}:",
        ]
        for choice in service.endpoints:
            pod = "/".join(choice.pod) if choice.pod else "-"
            eligible = "eligible" if choice.eligible else "not eligible"
            lines.append(
                f"           {_endpoint(choice.address, choice.port)} {pod} on "
                f"{choice.node or '?'}: {eligible}, {choice.reason}"
            )
        if service.no_endpoint:
            lines.append(f"         no eligible endpoint: {service.no_endpoint}")
    elif explanation.destination_pod is not None:
        pod = "/".join(explanation.destination_pod)
        lines.append(f"to       Pod {pod} {target} {explanation.protocol}")
    else:
        lines.append(f"to       {target} {explanation.protocol}")
    lines += [f"note     {note}" for note in explanation.notes]
    for number, leg in enumerate(explanation.legs, 1):
        head = f"connection {number} of {len(explanation.legs)}"
        if service is not None:
            head += f": DNAT {target} -> {_endpoint(leg.address, leg.port)}"
        if leg.masquerade_reason:
            masquerade = "masqueraded" if leg.masquerade else "not masqueraded"
            head += f", {masquerade} ({leg.masquerade_reason})"
        lines.append(head)
        lines += _direction_lines(leg.egress) + _direction_lines(leg.ingress)
        lines.append(f"  => {_verdict(leg.allowed)}")
        if leg.staged is not None:
            lines.append(_staged_line(leg.staged))
    denied = sum(not leg.allowed for leg in explanation.legs)
    verdict = f"verdict  {_verdict(explanation.allowed)}"
    if len(explanation.legs) > 1 and denied:
        verdict += f" ({denied} of {len(explanation.legs)} endpoints denied)"
    elif not explanation.legs:
        verdict += " (no connection is made)"
    lines.append(verdict)
    if explanation.staged_shown is not None:
        would_deny = sum(not leg.would_allow for leg in explanation.legs)
        staged = f"staged   would {_verdict(explanation.would_allow)}"
        if len(explanation.legs) > 1 and would_deny:
            staged += f" ({would_deny} of {len(explanation.legs)} endpoints denied)"
        lines.append(staged + ", with the staged policies enforced")
    return "\n".join(lines) + "\n"


def _rule_check_json(check: RuleCheck) -> dict[str, Any]:
    expected = check.expected
    return {
        "direction": expected.direction.lower(),
        "node": expected.node,
        "judgement": check.judgement,
        "expected": {
            "verdict": _verdict(expected.allowed),
            "decidedBy": decided_json(expected.decided_by),
        },
        "records": check.records,
        "recorded": check.recorded,
        "reason": check.why or None,
    }


def verification_json(verification: Verification) -> dict[str, Any]:
    """`verify` of docs/observability.md's schema: whether every probe agrees with the
    explanation, and each probe with the deciding rule of each direction checked against the
    flow records."""
    return {
        "agrees": verification.agrees,
        "container": verification.pod,
        "probes": [
            {
                "address": answer.probe.address,
                "port": answer.probe.port,
                "protocol": answer.probe.protocol,
                "target": answer.probe.target,
                "expected": _verdict(answer.probe.expected),
                "outcome": answer.outcome,
                "judgement": answer.judgement,
                "rule": answer.rule,
                "rules": [_rule_check_json(check) for check in answer.rules],
            }
            for answer in verification.answers
        ],
        "skipped": list(verification.skipped),
    }


def _rule_lines(answer: Answer) -> list[str]:
    """Each direction's deciding rule against the records, under the probe's line."""
    if answer.probe.leg is None:
        return ["           rule not checked: the proxy picks the endpoint, whose probe checks it"]
    lines = []
    for check in answer.rules:
        expected = check.expected
        head = f"           {expected.direction.lower():<7} on {expected.node or '-'}: rule "
        if check.judgement == AGREES:
            lines.append(f"{head}agrees ({check.records} recorded: {expected.decided_by.reason})")
        elif check.judgement == DISAGREES and check.recorded is not None:
            recorded = check.recorded
            lines.append(
                f"{head}DISAGREES: recorded {recorded['verdict']} "
                f"({recorded['decidedBy']['reason']}), explained "
                f"{_verdict(expected.allowed)} ({expected.decided_by.reason})"
            )
        else:
            lines.append(f"{head}not checked: {check.why}")
    return lines


def verification_text(verification: Verification) -> str:
    lines = [f"probes   from the source pod (ephemeral container {verification.pod}):"]
    for answer in verification.answers:
        probe = answer.probe
        lines.append(
            f"         {_endpoint(probe.address, probe.port)} {probe.protocol} ({probe.target}): "
            f"expected {_verdict(probe.expected)}, {answer.outcome}: {answer.judgement}"
        )
        lines += _rule_lines(answer)
    lines += [f"         not probed: {why}" for why in verification.skipped]
    total = len(verification.answers)
    rules = Counter(answer.rule for answer in verification.answers)
    ruled = ", ".join(f"{count} {judgement}" for judgement, count in sorted(rules.items()))
    of = f"of {total} probes" + (f"; deciding rule: {ruled}" if ruled else "")
    if verification.agrees:
        lines.append(f"verify   the kernel agrees ({total} {of})")
    else:
        counts = Counter(answer.judgement for answer in verification.answers)
        found = ", ".join(f"{count} {judgement}" for judgement, count in sorted(counts.items()))
        lines.append(f"verify   NOT CONFIRMED ({found}, {of})")
    return "\n".join(lines) + "\n"
