"""`kubectl knit explain` on fixed clusters: the destination resolved as the proxy resolves it,
and each direction's deciding rule. The objects are API-shaped and go through the daemon's
parsers; the two nodes' tables come from its compiler. Then `--verify`'s pure half: what is
probed, how an outcome judges the explanation, how the flow records of the probes judge each
direction's deciding rule, its output."""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from proxyd.explain import cli, flows, probe
from proxyd.explain.cli import parse_target
from proxyd.explain.explain import (
    AddressTarget,
    Explainer,
    ExplainError,
    Explanation,
    NamedTarget,
    PodTarget,
    Question,
    Service,
    ServiceTarget,
    Target,
    World,
)
from proxyd.explain.output import to_json, to_text, verification_json, verification_text
from proxyd.explain.verify import (
    AGREES,
    DISAGREES,
    INCONCLUSIVE,
    NOT_CHECKED,
    Answer,
    Probe,
    Records,
    Verification,
    checked,
    judging_nodes,
    probes,
)
from proxyd.model import NodeInfo, parse_endpoint_slice, parse_service
from proxyd.policy.cluster_model import parse_cluster_policy
from proxyd.policy.model import EGRESS, INGRESS, Namespace, parse_pod, parse_policy

NODES = {
    "n1": NodeInfo("n1", zone="a", addresses=("192.168.0.1",)),
    "n2": NodeInfo("n2", zone="b", addresses=("192.168.0.2",)),
}
NAMESPACES = {n: Namespace(n, {"kubernetes.io/metadata.name": n}) for n in ("x", "y")}
CLIENT = ("y", "client")


def pod(ns: str, name: str, ip: str, node: str, app: str, ports: list[Any] | None = None) -> Any:
    return parse_pod({
        "metadata": {"namespace": ns, "name": name, "labels": {"app": app}},
        "spec": {"nodeName": node, "containers": [{"ports": ports or []}]},
        "status": {"phase": "Running", "podIPs": [{"ip": ip}]},
    })  # fmt: skip


WEB_PORTS = [
    {"name": "http", "containerPort": 8080},
    {"name": "assoc", "containerPort": 9000, "protocol": "SCTP"},
]
PODS = [
    pod("x", "web-0", "10.0.1.10", "n1", "web", WEB_PORTS),
    pod("x", "web-1", "10.0.2.11", "n2", "web", WEB_PORTS),
    pod("x", "other", "10.0.1.12", "n1", "other"),
    pod("y", "client", "10.0.2.20", "n2", "client"),
]


def service(spec: dict[str, Any], name: str = "web") -> Service:
    obj = {
        "metadata": {"namespace": "x", "name": name},
        "spec": {"clusterIP": "10.96.0.10", "ports": [{"name": "http", "port": 80}], **spec},
    }
    return Service("x", name, spec.get("type", "ClusterIP"), tuple(parse_service(obj)))


def endpoint(ip: str, node: str, **conditions: Any) -> dict[str, Any]:
    hints = conditions.pop("zones", None)
    entry = {"addresses": [ip], "nodeName": node, "conditions": {"ready": True, **conditions}}
    return {**entry, "hints": {"forZones": [{"name": z} for z in hints]}} if hints else entry


READY = [endpoint("10.0.1.10", "n1"), endpoint("10.0.2.11", "n2")]


def endpoint_slice(endpoints: list[dict[str, Any]], name: str = "web") -> Any:
    return parse_endpoint_slice({
        "metadata": {"namespace": "x", "name": f"{name}-abc",
                     "labels": {"kubernetes.io/service-name": name}},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080}],
        "endpoints": endpoints,
    })  # fmt: skip


def policy(ns: str, name: str, spec: dict[str, Any]) -> Any:
    return parse_policy({"metadata": {"namespace": ns, "name": name}, "spec": spec})


def cluster_policy(name: str, tier: str, priority: int, action: str, **spec: Any) -> Any:
    subject = {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "web"}}}}
    rule = {"action": action, "name": f"{action.lower()}-y", "from": [{"namespaces": IN_Y}]}
    body = {"tier": tier, "priority": priority, "subject": subject, "ingress": [rule], **spec}
    return parse_cluster_policy({"metadata": {"name": name}, "spec": body})


IN_Y = {"matchLabels": {"kubernetes.io/metadata.name": "y"}}
DENY_ALL = {"podSelector": {}, "policyTypes": ["Ingress"]}
FROM_Y_HTTP = {
    "podSelector": {"matchLabels": {"app": "web"}},
    "ingress": [{"from": [{"namespaceSelector": IN_Y}], "ports": [{"port": "http"}]}],
}


def world(
    policies: tuple[Any, ...] = (),
    cluster_policies: tuple[Any, ...] = (),
    services: tuple[Service, ...] = (),
    endpoints: list[dict[str, Any]] = READY,
    **options: Any,
) -> World:
    return World(
        {(p.namespace, p.name): p for p in PODS},
        NAMESPACES,
        policies,
        cluster_policies,
        {(s.namespace, s.name): s for s in services},
        {("x", s.name): (endpoint_slice(endpoints, s.name),) for s in services},
        NODES,
        **options,
    )


def explain(
    the_world: World, target: Target, port: int | str, protocol: str = "TCP", **question: Any
) -> Explanation:
    explanation = Explainer(the_world).explain(Question(CLIENT, target, port, protocol, **question))
    json.dumps(to_json(explanation))  # the JSON is JSON, whatever the case
    assert to_text(explanation).endswith("\n")
    return explanation


WEB_0 = PodTarget("x", "web-0")

# ------------------------------------------------------------ pod to pod


def test_no_policy_judges_a_pod_that_none_selects() -> None:
    explanation = explain(world(), WEB_0, 8080)
    assert explanation.allowed
    (leg,) = explanation.legs
    assert (leg.egress.node, leg.ingress.node) == ("n2", "n1")
    assert leg.egress.decided_by.kind == leg.ingress.decided_by.kind == "Default"
    assert "not isolated" in leg.ingress.decided_by.reason
    assert to_json(explanation)["verdict"] == "allow"


def test_an_isolated_pod_that_no_rule_allows_names_its_isolating_policies() -> None:
    explanation = explain(world((policy("x", "deny-all", DENY_ALL),)), WEB_0, 8080)
    assert not explanation.allowed
    ingress = to_json(explanation)["ingress"]
    assert ingress["verdict"] == "deny"
    assert ingress["decidedBy"] | {"reason": ""} == {
        "kind": "NetworkPolicy", "namespace": "x", "name": "deny-all", "tier": "NetworkPolicy",
        "priority": None, "rule": None, "ruleName": None, "action": None, "reason": "",
    }  # fmt: skip
    assert ingress["path"][-1]["rule"] is None, "the chain's end decided"
    assert to_json(explanation)["egress"]["decidedBy"]["kind"] == "Default"


def test_the_networkpolicy_that_allows_is_named_and_a_named_port_resolves_on_the_pod() -> None:
    policies = (policy("x", "deny-all", DENY_ALL), policy("x", "from-y", FROM_Y_HTTP))
    explanation = explain(world(policies), WEB_0, "http")
    assert explanation.allowed and explanation.port == 8080
    decided = explanation.legs[0].ingress.decided_by
    assert (decided.kind, decided.namespace, decided.name, decided.rule) == (
        "NetworkPolicy", "x", "from-y", 0,
    )  # fmt: skip
    assert explanation.legs[0].ingress.judged_by == ("deny-all", "from-y")
    assert not explain(world(policies), WEB_0, 8081).allowed


def test_an_egress_deny_leaves_ingress_unreached() -> None:
    only_dns = {
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": [{"ports": [{"port": 53, "protocol": "UDP"}]}],
    }
    explanation = explain(world((policy("y", "only-dns", only_dns),)), WEB_0, 8080)
    (leg,) = explanation.legs
    assert not leg.egress.allowed and leg.egress.decided_by.name == "only-dns"
    assert not leg.ingress.reached and leg.ingress.allowed
    assert explain(world((policy("y", "only-dns", only_dns),)), WEB_0, 53, "UDP").allowed


def test_sctp_is_judged_by_its_own_protocol() -> None:
    sctp_only = {
        "podSelector": {},
        "ingress": [{"ports": [{"port": "assoc", "protocol": "SCTP"}]}],
    }
    the_world = world((policy("x", "sctp", sctp_only),))
    explanation = explain(the_world, WEB_0, "assoc", "SCTP")
    assert explanation.allowed and explanation.port == 9000
    assert explanation.legs[0].ingress.decided_by.name == "sctp"
    assert not explain(the_world, WEB_0, 9000, "TCP").allowed


# ------------------------------------------------------------ ClusterNetworkPolicy tiers


def test_an_admin_deny_decides_before_a_networkpolicy_allow() -> None:
    the_world = world(
        (policy("x", "allow-all", {"podSelector": {}, "ingress": [{}]}),),
        (cluster_policy("block-y", "Admin", 5, "Deny"),),
    )
    decided = to_json(explain(the_world, WEB_0, 8080))["ingress"]["decidedBy"]
    assert decided | {"reason": ""} == {
        "kind": "ClusterNetworkPolicy", "namespace": None, "name": "block-y", "tier": "Admin",
        "priority": 5, "rule": 0, "ruleName": "deny-y", "action": "Deny", "reason": "",
    }  # fmt: skip


def test_an_admin_accept_decides_before_an_isolating_networkpolicy() -> None:
    the_world = world(
        (policy("x", "deny-all", DENY_ALL),), (cluster_policy("let-y", "Admin", 1, "Accept"),)
    )
    explanation = explain(the_world, WEB_0, 8080)
    assert explanation.allowed
    assert explanation.legs[0].ingress.decided_by.name == "let-y"


def test_an_admin_pass_leaves_it_to_the_networkpolicies_and_the_path_shows_it() -> None:
    cluster_policies = (
        cluster_policy("pass-y", "Admin", 1, "Pass"),
        cluster_policy("block-y", "Admin", 2, "Deny"),
    )
    policies = (policy("x", "deny-all", DENY_ALL), policy("x", "from-y", FROM_Y_HTTP))
    ingress = to_json(explain(world(policies, cluster_policies), WEB_0, 8080))["ingress"]
    assert ingress["verdict"] == "allow"
    assert [hop["verdict"] for hop in ingress["path"]] == ["pass", "allow"]
    assert ingress["path"][0]["decidedBy"]["name"] == "pass-y"
    assert ingress["path"][1]["chain"].endswith("-next")
    assert ingress["decidedBy"]["name"] == "from-y"
    # without the NetworkPolicy's allow, the pass ends in the isolation's drop
    denied = to_json(explain(world(policies[:1], cluster_policies), WEB_0, 8080))["ingress"]
    assert [hop["verdict"] for hop in denied["path"]] == ["pass", "drop"]
    assert denied["decidedBy"]["name"] == "deny-all"


def test_baseline_judges_only_a_pod_no_networkpolicy_isolates() -> None:
    baseline = (cluster_policy("default-deny-y", "Baseline", 10, "Deny"),)
    decided = explain(world((), baseline), WEB_0, 8080).legs[0].ingress.decided_by
    assert (decided.tier, decided.name, decided.action) == ("Baseline", "default-deny-y", "Deny")
    allow_all = (policy("x", "allow-all", {"podSelector": {}, "ingress": [{}]}),)
    explanation = explain(world(allow_all, baseline), WEB_0, 8080)
    assert explanation.allowed
    assert explanation.legs[0].ingress.decided_by.name == "allow-all"


def test_a_baseline_that_does_not_match_leaves_the_default() -> None:
    baseline = (cluster_policy("default-deny-y", "Baseline", 10, "Deny"),)
    explanation = Explainer(world((), baseline)).explain(Question(("x", "other"), WEB_0, 8080))
    ingress = explanation.legs[0].ingress
    assert ingress.allowed and ingress.decided_by.kind == "Default"
    assert ingress.judged_by == ("default-deny-y",) and ingress.path[-1].index is None


# ------------------------------------------------------------ staged policies


def staged(the_policy: Any) -> Any:
    return dataclasses.replace(the_policy, staged=True)


def test_a_staged_default_deny_changes_no_verdict_and_says_it_would_deny() -> None:
    the_world = world((staged(policy("x", "deny-all", DENY_ALL)),), services=(service({}),))
    explanation = explain(the_world, NamedTarget("x", "web"), 80)
    assert explanation.allowed and not explanation.would_allow
    for leg in explanation.legs:
        assert leg.ingress.decided_by.kind == "Default"
        assert leg.staged is not None and leg.staged.changed == (INGRESS,)
        assert leg.staged.ingress.decided_by.name == "deny-all"
    out = to_json(explanation)
    assert out["verdict"] == "allow" and out["ingress"]["verdict"] == "allow"
    assert out["staged"]["verdict"] == "deny" and out["staged"]["changed"] == ["ingress"]
    assert out["staged"]["ingress"]["decidedBy"] | {"reason": ""} == {
        "kind": "NetworkPolicy", "namespace": "x", "name": "deny-all", "tier": "NetworkPolicy",
        "priority": None, "rule": None, "ruleName": None, "action": None, "reason": "",
    }  # fmt: skip
    assert out["staged"]["egress"]["verdict"] == "allow", "both directions, as the view judges"
    assert [c["staged"]["verdict"] for c in out["connections"]] == ["deny", "deny"]
    text = to_text(explanation)
    assert (
        text.count(
            "  staged: would deny (ingress: isolated by NetworkPolicy deny-all; no rule allows)\n"
        )
        == 2
    )
    assert text.endswith(
        "verdict  allow\nstaged   would deny (2 of 2 endpoints denied), with the staged "
        "policies enforced\n"
    )


def test_staged_shows_only_what_it_changes_and_nothing_without_a_staged_policy() -> None:
    policies = (policy("x", "deny-all", DENY_ALL), policy("x", "from-y", FROM_Y_HTTP))
    enforced = explain(world(policies), WEB_0, 8080)
    assert enforced.legs[0].staged is None and to_json(enforced)["staged"] is None
    assert "staged" not in to_text(enforced)
    # a staged isolation of a pod isolated already, and the same rule allowing: no change
    also_isolating = (*policies, staged(policy("x", "isolate-too", DENY_ALL)))
    for port in (8080, 8081):
        same = explain(world(also_isolating), WEB_0, port)
        assert same.legs[0].staged is None and to_json(same)["staged"] is None
    # a staged Admin deny decides before the NetworkPolicy that allows
    blocking = (staged(cluster_policy("block-y", "Admin", 5, "Deny")),)
    explanation = explain(world(policies, blocking), WEB_0, 8080)
    assert explanation.allowed and not explanation.would_allow
    ingress = to_json(explanation)["staged"]["ingress"]
    assert (ingress["decidedBy"]["name"], ingress["decidedBy"]["action"]) == ("block-y", "Deny")
    assert "  staged: would deny (ingress: ClusterNetworkPolicy block-y (Admin tier, priority 5) " \
        "ingress rule 0: Deny)\n" in to_text(explanation)  # fmt: skip


def test_a_staged_allow_says_it_would_allow_what_is_denied() -> None:
    policies = (policy("x", "deny-all", DENY_ALL), staged(policy("x", "from-y", FROM_Y_HTTP)))
    explanation = explain(world(policies), WEB_0, 8080)
    assert not explanation.allowed and explanation.would_allow
    out = to_json(explanation)
    assert out["verdict"] == "deny" and out["staged"]["verdict"] == "allow"
    assert out["staged"]["ingress"]["decidedBy"]["name"] == "from-y"
    assert "staged   would allow, with the staged policies enforced\n" in to_text(explanation)


def test_a_staged_egress_deny_leaves_the_staged_ingress_unreached() -> None:
    only_dns = {
        "podSelector": {},
        "policyTypes": ["Egress"],
        "egress": [{"ports": [{"port": 53, "protocol": "UDP"}]}],
    }
    the_world = world((staged(policy("y", "only-dns", only_dns)), policy("x", "deny", DENY_ALL)))
    (leg,) = explain(the_world, WEB_0, 8080).legs
    assert leg.staged is not None and leg.staged.changed == (EGRESS,)
    assert not leg.staged.egress.allowed and not leg.staged.ingress.reached


# ------------------------------------------------------------ Services


def test_a_cluster_ip_is_explained_per_eligible_endpoint_with_the_reasons_for_the_others() -> None:
    isolate_web_1 = {
        "podSelector": {"matchLabels": {"app": "web"}},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "other"}}}]}],
    }
    endpoints = [*READY, endpoint("10.0.1.13", "n1", ready=False)]
    the_world = world((policy("x", "from-other", isolate_web_1),), (), (service({}),), endpoints)
    explanation = explain(the_world, ServiceTarget("x", "web"), 80)
    assert explanation.service is not None
    assert [(e.address, e.eligible, e.reason) for e in explanation.service.endpoints] == [
        ("10.0.1.10", True, "ready"),
        ("10.0.1.13", False, "not ready"),
        ("10.0.2.11", True, "ready"),
    ]
    assert [(leg.address, leg.port, leg.masquerade) for leg in explanation.legs] == [
        ("10.0.1.10", 8080, False), ("10.0.2.11", 8080, False),
    ]  # fmt: skip
    assert not explanation.allowed
    shown = to_json(explanation)
    assert shown["connections"][0]["dnat"] == {"from": "10.96.0.10:80", "to": "10.0.1.10:8080"}
    assert shown["ingress"]["decidedBy"]["name"] == "from-other"
    assert "2 of 2 endpoints denied" in to_text(explanation)
    one = explain(the_world, ServiceTarget("x", "web"), "http", endpoint="10.0.2.11")
    assert [leg.address for leg in one.legs] == ["10.0.2.11"]
    with pytest.raises(ExplainError, match="not an eligible endpoint"):
        explain(the_world, ServiceTarget("x", "web"), 80, endpoint="10.0.1.13")


def test_internal_traffic_policy_local_keeps_the_source_nodes_endpoints() -> None:
    the_world = world(services=(service({"internalTrafficPolicy": "Local"}),))
    explanation = explain(the_world, ServiceTarget("x", "web"), 80)
    assert explanation.service is not None
    assert [(e.address, e.eligible) for e in explanation.service.endpoints] == [
        ("10.0.1.10", False), ("10.0.2.11", True),
    ]  # fmt: skip
    assert "internalTrafficPolicy Local" in explanation.service.endpoints[0].reason
    # no endpoint on the source's node: the proxy drops
    alone = world(services=(service({"internalTrafficPolicy": "Local"}),), endpoints=READY[:1])
    dropped = explain(alone, ServiceTarget("x", "web"), 80)
    assert not dropped.allowed and not dropped.legs
    assert dropped.service is not None and dropped.service.no_endpoint is not None
    assert dropped.service.no_endpoint.startswith("drop")
    assert to_json(dropped)["egress"] is None


def test_topology_hints_and_terminating_endpoints() -> None:
    hinted = [endpoint("10.0.1.10", "n1", zones=["a"]), endpoint("10.0.2.11", "n2", zones=["b"])]
    explanation = explain(
        world(services=(service({}),), endpoints=hinted), ServiceTarget("x", "web"), 80
    )
    assert explanation.service is not None
    assert [e.eligible for e in explanation.service.endpoints] == [False, True]
    assert "topology hints: for zones a" in explanation.service.endpoints[0].reason
    terminating = [endpoint("10.0.1.10", "n1", ready=False, serving=True, terminating=True)]
    fallback = explain(
        world(services=(service({}),), endpoints=terminating), ServiceTarget("x", "web"), 80
    )
    assert fallback.service is not None and fallback.service.endpoints[0].eligible
    assert "no endpoint is ready" in fallback.service.endpoints[0].reason
    both = [READY[1], endpoint("10.0.1.10", "n1", ready=False, serving=True, terminating=True)]
    mixed = explain(world(services=(service({}),), endpoints=both), ServiceTarget("x", "web"), 80)
    assert mixed.service is not None
    assert mixed.service.endpoints[0].reason == "terminating: ready endpoints exist"


def test_an_external_ip_under_each_external_traffic_policy() -> None:
    from_y = {
        "podSelector": {},
        "ingress": [{"from": [{"namespaceSelector": IN_Y}]}],
    }
    external = {"type": "LoadBalancer", "externalIPs": ["203.0.113.5"]}
    for policy_name, masqueraded in (("Cluster", True), ("Local", False)):
        spec = {**external, "externalTrafficPolicy": policy_name}
        the_world = world((policy("x", "from-y", from_y),), (), (service(spec),))
        explanation = explain(the_world, AddressTarget("203.0.113.5"), 80)
        assert explanation.service is not None
        assert explanation.service.frontend == "ExternalIP"
        legs = {leg.address: leg for leg in explanation.legs}
        assert {leg.masquerade for leg in legs.values()} == {masqueraded}
        # the masquerade of the source's node comes before the other node's ingress policy
        assert legs["10.0.1.10"].allowed is not masqueraded, policy_name
        assert legs["10.0.2.11"].allowed, "same node: judged before the masquerade"


def test_masquerade_all_and_hairpin() -> None:
    the_world = world(services=(service({}),), masquerade_all=True)
    legs = explain(the_world, ServiceTarget("x", "web"), 80).legs
    assert all(leg.masquerade and leg.masquerade_reason == "masqueradeAll" for leg in legs)
    hairpin = Explainer(world(services=(service({}),))).explain(
        Question(("x", "web-0"), ServiceTarget("x", "web"), 80)
    )
    itself = hairpin.legs[0]
    assert itself.masquerade and itself.masquerade_reason.startswith("hairpin")
    assert itself.ingress.decided_by.kind == "Unjudged" and itself.allowed


# ------------------------------------------------------------ addresses


def test_an_address_resolves_to_a_service_frontend_a_pod_or_an_outside_address() -> None:
    the_world = world(services=(service({}),))
    assert explain(the_world, AddressTarget("10.96.0.10"), 80).destination == "Service"
    assert explain(the_world, AddressTarget("10.96.0.10"), 81).destination == "Address"
    to_pod = explain(the_world, AddressTarget("10.0.1.10"), 8080)
    assert to_pod.destination == "Pod" and to_pod.destination_pod == ("x", "web-0")
    outside = explain(
        world((policy("y", "no-egress", {"podSelector": {}, "policyTypes": ["Egress"]}),)),
        AddressTarget("192.0.2.7"),
        443,
    )
    (leg,) = outside.legs
    assert not outside.allowed and leg.egress.decided_by.name == "no-egress"
    assert leg.ingress.decided_by.kind == "Unjudged"
    own_node = explain(the_world, AddressTarget("192.168.0.2"), 10250)
    assert own_node.allowed and own_node.legs[0].egress.decided_by.kind == "Unjudged"


def test_a_name_is_a_service_first_and_a_pod_otherwise() -> None:
    the_world = world(services=(service({}, name="web-0"),))
    named = explain(the_world, NamedTarget("x", "web-0"), 80)
    assert named.destination == "Service" and "pod/x/web-0" in named.notes[0]
    assert explain(world(), NamedTarget("x", "web-0"), 8080).destination == "Pod"


@pytest.mark.parametrize(
    ("question", "message"),
    [
        (Question(("y", "nobody"), WEB_0, 80), "no pod y/nobody"),
        (Question(CLIENT, PodTarget("x", "nobody"), 80), "no pod x/nobody"),
        (Question(CLIENT, WEB_0, "metrics"), "no TCP port named 'metrics'"),
        (Question(CLIENT, ServiceTarget("x", "web"), 443), "has no TCP port 443"),
        (Question(CLIENT, ServiceTarget("x", "gone"), 80), "no Service x/gone"),
        (Question(CLIENT, AddressTarget("192.0.2.7"), "http"), "needs a pod or Service"),
    ],
)
def test_questions_that_cannot_be_answered(question: Question, message: str) -> None:
    with pytest.raises(ExplainError, match=message):
        Explainer(world(services=(service({}),))).explain(question)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x/web:80", (NamedTarget("x", "web"), 80)),
        ("pod/x/web-0:http", (PodTarget("x", "web-0"), "http")),
        ("svc/x/web:http", (ServiceTarget("x", "web"), "http")),
        ("10.96.0.10:53", (AddressTarget("10.96.0.10"), 53)),
        ("[fd00::0010]:443", (AddressTarget("fd00::10"), 443)),
    ],
)
def test_targets_as_written(text: str, expected: tuple[Target, int | str]) -> None:
    assert parse_target(text) == expected


@pytest.mark.parametrize("text", ["web:80", "x/web", "x/web:0", "a/b/c/d:80", "node/x/y:80"])
def test_targets_that_are_not(text: str) -> None:
    with pytest.raises(ExplainError):
        parse_target(text)


# ------------------------------------------------------------ --verify: what is probed, how an
# outcome judges the explanation, and the output (the probes themselves run on the lab:
# tests/cluster/test_explain_agrees.py)

ISOLATE_WEB = {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"]}


def test_a_pod_is_probed_once_at_its_address_and_port() -> None:
    explanation = explain(world((policy("x", "deny", ISOLATE_WEB),)), PodTarget("x", "web-0"), 8080)
    found, skipped = probes(explanation)
    assert found == [Probe("10.0.1.10", 8080, "TCP", "x/web-0", False, explanation.legs[0])]
    assert skipped == []


def test_a_service_is_probed_at_each_endpoint_and_at_its_frontend_when_they_agree() -> None:
    allowed = explain(world((policy("x", "from-y", FROM_Y_HTTP),), services=(service({}),)),
                      ServiceTarget("x", "web"), 80)  # fmt: skip
    found, skipped = probes(allowed)
    assert [(p.address, p.port, p.expected) for p in found] == [
        ("10.0.1.10", 8080, True), ("10.0.2.11", 8080, True), ("10.96.0.10", 80, True),
    ]  # fmt: skip
    assert found[-1].target == "Service x/web" and skipped == []
    assert [p.leg for p in found] == [*allowed.legs, None], "the proxy picks the frontend's"
    assert judging_nodes(found) == {"n1", "n2"}


def test_a_service_whose_endpoints_differ_is_not_probed_at_its_frontend() -> None:
    # web-0 is isolated, `other` (10.0.1.12) is not: the proxy's pick decides the frontend's
    endpoints = [endpoint("10.0.1.10", "n1"), endpoint("10.0.1.12", "n1")]
    the_world = world((policy("x", "deny", ISOLATE_WEB),), services=(service({}),),
                      endpoints=endpoints)  # fmt: skip
    found, skipped = probes(explain(the_world, ServiceTarget("x", "web"), 80))
    assert [(p.address, p.expected) for p in found] == [("10.0.1.10", False), ("10.0.1.12", True)]
    assert skipped == [
        "10.96.0.10:80: its endpoints' verdicts differ, so the proxy's choice decides"
    ]


def test_a_masqueraded_connection_is_not_probed_directly() -> None:
    the_world = world(services=(service({}),), masquerade_all=True)
    found, skipped = probes(explain(the_world, ServiceTarget("x", "web"), 80))
    assert [p.address for p in found] == ["10.96.0.10"]
    assert len(skipped) == 2 and all("masqueraded" in why for why in skipped)


def test_a_service_without_an_eligible_endpoint_must_not_connect() -> None:
    the_world = world(services=(service({}),), endpoints=[endpoint("10.0.1.10", "n1", ready=False)])
    found, _ = probes(explain(the_world, ServiceTarget("x", "web"), 80))
    assert [(p.address, p.expected) for p in found] == [("10.96.0.10", False)]


ALLOWED = Probe("10.0.1.10", 8080, "TCP", "x/web-0", True)
DENIED = Probe("fd00::10", 8080, "UDP", "x/web-0", False)


def test_an_outcome_judges_the_expected_verdict() -> None:
    # reached the destination: connected, or refused by it (nothing listens); a drop times out
    assert [Answer(ALLOWED, outcome).judgement for outcome in ("connected", "refused")] == [
        AGREES, AGREES,
    ]  # fmt: skip
    assert Answer(ALLOWED, "timed out").judgement == DISAGREES
    assert Answer(DENIED, "timed out").judgement == AGREES
    assert Answer(DENIED, "connected").judgement == DISAGREES
    assert Answer(DENIED, "error: unknown host").judgement == INCONCLUSIVE
    assert Answer(DENIED, probe.NO_ANSWER).judgement == INCONCLUSIVE


def test_the_container_log_is_read_per_probe_and_a_missing_line_is_no_answer() -> None:
    printed = "10.0.1.10 8080 connected\nfd00::10 8080 error: dial udp: bad address\n"
    answers = probe.parse(printed, [ALLOWED, DENIED, Probe("10.0.9.9", 80, "TCP", "-", True)])
    assert [a.outcome for a in answers] == [
        "connected", "error: dial udp: bad address", probe.NO_ANSWER,
    ]  # fmt: skip


def test_the_container_probes_each_address_in_its_family_form() -> None:
    container: dict[str, Any] = probe._container("knit-verify-1", probe.IMAGE, [ALLOWED, DENIED])
    command = container["command"]
    assert command[:2] == ["sh", "-c"] and "/agnhost connect" in command[2]
    assert command[4:] == [str(probe.PROBE_TIMEOUT), "10.0.1.10", "8080", "tcp",
                           "fd00::10", "8080", "udp"]  # fmt: skip
    assert "[$address]:$port" in command[2]


def test_the_output_says_whether_the_kernel_agrees() -> None:
    agreeing = Verification("knit-verify-1", (Answer(ALLOWED, "connected"),), ())
    assert agreeing.agrees
    assert "verify   the kernel agrees (1 of 1 probes; deciding rule: 1 not checked)" in (
        verification_text(agreeing)
    )
    mixed = Verification(
        "knit-verify-2",
        (Answer(ALLOWED, "timed out"), Answer(DENIED, "timed out")),
        ("10.96.0.10:80: its endpoints' verdicts differ, so the proxy's choice decides",),
    )
    assert not mixed.agrees
    text = verification_text(mixed)
    assert "[fd00::10]:8080 UDP (x/web-0): expected deny, timed out: agrees" in text
    assert "not probed: 10.96.0.10:80" in text
    assert (
        "NOT CONFIRMED (1 agrees, 1 disagrees, of 2 probes; deciding rule: 2 not checked)" in text
    )
    shown = json.loads(json.dumps(verification_json(mixed)))
    assert shown["agrees"] is False and shown["container"] == "knit-verify-2"
    assert shown["probes"][0] == {
        "address": "10.0.1.10", "port": 8080, "protocol": "TCP", "target": "x/web-0",
        "expected": "allow", "outcome": "timed out", "judgement": "disagrees",
        "rule": "not checked", "rules": [],
    }  # fmt: skip
    assert len(shown["skipped"]) == 1


# ------------------------------------------------------------ --verify: the deciding rule
# against the flow records the probes left (the records read as the daemons serve them)

SINCE = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
LATER = "2026-01-02T03:04:06.250Z"
OUT_TO_X = {
    "podSelector": {"matchLabels": {"app": "client"}},
    "policyTypes": ["Egress"],
    "egress": [
        {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "x"}}}]}
    ],
}
ALLOWED_BOTH_WAYS = (
    policy("x", "deny", ISOLATE_WEB), policy("x", "from-y", FROM_Y_HTTP),
    policy("y", "out-to-x", OUT_TO_X),
)  # fmt: skip


def decided(kind: str, reason: str, **fields: Any) -> dict[str, Any]:
    """A record's `decidedBy`, as the daemon writes it."""
    empty = dict.fromkeys(("namespace", "name", "tier", "priority", "rule", "ruleName", "action"))
    return {"kind": kind, **empty, **fields, "reason": reason}


def accepted(namespace: str, name: str, direction: str) -> dict[str, Any]:
    return decided(
        "NetworkPolicy", f"NetworkPolicy {namespace}/{name} (NetworkPolicy tier) {direction} "
        "rule 0: Accept", namespace=namespace, name=name, tier="NetworkPolicy", rule=0,
        action="Accept",
    )  # fmt: skip


def isolated(name: str) -> dict[str, Any]:
    return decided("NetworkPolicy", f"isolated by NetworkPolicy {name}; no rule allows",
                   namespace="x", name=name, tier="NetworkPolicy")  # fmt: skip


WEB_0_KEY = ("x", "web-0")
NOT_ISOLATED = decided(
    "Default", "not isolated by a NetworkPolicy, and no ClusterNetworkPolicy rule denies: allowed"
)


def flow(
    direction: str,
    node: str,
    verdict: str,
    decided_by: dict[str, Any],
    staged: dict[str, Any] | None = None,
    at: str = LATER,
    port: int = 8080,
    source: tuple[str, str] = CLIENT,
) -> dict[str, Any]:
    """A record of a connection from `source` (10.0.2.20) to web-0 (10.0.1.10)."""

    def end(address: str, port: int | None, pod: tuple[str, str]) -> dict[str, Any]:
        return {"address": address, "port": port, "pod": {"namespace": pod[0], "name": pod[1]}}

    return {
        "time": at, "node": node, "direction": direction, "verdict": verdict, "protocol": "TCP",
        "source": end("10.0.2.20", 40000, source), "destination": end("10.0.1.10", port, WEB_0_KEY),
        "chain": f"{direction}-X", "rule": decided_by["rule"], "decidedBy": decided_by,
        "staged": staged,
    }  # fmt: skip


def checked_answer(
    explanation: Explanation, outcome: str, *found: dict[str, Any], **unread: str
) -> Answer:
    (probe,) = probes(explanation)[0]
    return checked(explanation, Answer(probe, outcome), Records(SINCE, found, unread))


def test_records_of_the_rule_explained_agree_in_both_directions() -> None:
    explanation = explain(world(ALLOWED_BOTH_WAYS), WEB_0, 8080)
    egress = flow("egress", "n2", "allow", accepted("y", "out-to-x", "egress"))
    ingress = flow("ingress", "n1", "allow", accepted("x", "from-y", "ingress"))
    answer = checked_answer(explanation, "connected", egress, ingress, ingress)
    assert [(c.expected.direction, c.judgement, c.records) for c in answer.rules] == [
        (EGRESS, AGREES, 1), (INGRESS, AGREES, 2),
    ]  # fmt: skip
    assert answer.rule == AGREES and answer.rules[1].recorded == ingress
    verification = Verification("knit-verify-1", (answer,), ())
    assert verification.agrees
    text = verification_text(verification)
    assert "           egress  on n2: rule agrees (1 recorded: NetworkPolicy y/out-to-x " \
        "(NetworkPolicy tier) egress rule 0: Accept)\n" in text  # fmt: skip
    assert "(1 of 1 probes; deciding rule: 1 agrees)" in text
    rules = json.loads(json.dumps(verification_json(verification)))["probes"][0]["rules"]
    assert rules[0] | {"expected": None, "recorded": None} == {
        "direction": "egress", "node": "n2", "judgement": "agrees", "expected": None,
        "records": 1, "recorded": None, "reason": None,
    }  # fmt: skip
    assert rules[0]["expected"]["decidedBy"]["name"] == "out-to-x"
    assert rules[1]["recorded"] == ingress


def test_only_the_probes_own_records_are_compared() -> None:
    explanation = explain(world(ALLOWED_BOTH_WAYS), WEB_0, 8080)
    other = accepted("x", "other", "ingress")
    from_y = accepted("x", "from-y", "ingress")
    answer = checked_answer(
        explanation, "connected",
        flow("ingress", "n1", "allow", other, at="2026-01-02T03:04:04.999Z"),  # before
        flow("ingress", "n1", "allow", other, port=9000),  # another port
        flow("ingress", "n1", "allow", other, source=("y", "other")),  # another pod
        flow("ingress", "n2", "allow", other),  # another node
        flow("egress", "n1", "allow", other),  # the other direction
        flow("ingress", "n1", "allow", from_y, at="2026-01-02T03:04:05.000Z"),  # the first ms
    )  # fmt: skip
    assert [(c.judgement, c.records) for c in answer.rules] == [(NOT_CHECKED, 0), (AGREES, 1)]
    assert answer.rules[0].why == "no record on n2 (over --flow-records-rate then, or gone " \
        "from its ring)"  # fmt: skip
    assert answer.rule == NOT_CHECKED, "egress was judged, and left no record"


def test_a_recorded_rule_that_is_not_the_explanations_disagrees() -> None:
    explanation = explain(world(ALLOWED_BOTH_WAYS), WEB_0, 8080)
    egress = flow("egress", "n2", "allow", accepted("y", "out-to-x", "egress"))
    ingress = flow("ingress", "n1", "allow", accepted("x", "from-y", "ingress"))
    other = flow("ingress", "n1", "allow", accepted("x", "from-anywhere", "ingress"))
    answer = checked_answer(explanation, "connected", egress, ingress, other)
    assert answer.judgement == AGREES, "the verdict is the explanation's"
    assert [c.judgement for c in answer.rules] == [AGREES, DISAGREES]
    assert answer.rule == DISAGREES and answer.rules[1].recorded == other
    verification = Verification("knit-verify-2", (answer,), ())
    assert not verification.agrees
    text = verification_text(verification)
    assert (
        "           ingress on n1: rule DISAGREES: recorded allow (NetworkPolicy "
        "x/from-anywhere (NetworkPolicy tier) ingress rule 0: Accept), explained allow "
        "(NetworkPolicy x/from-y (NetworkPolicy tier) ingress rule 0: Accept)\n" in text
    )
    assert "NOT CONFIRMED (1 agrees, of 1 probes; deciding rule: 1 disagrees)" in text
    shown = json.loads(json.dumps(verification_json(verification)))
    assert shown["agrees"] is False and shown["probes"][0]["rule"] == "disagrees"
    # the same rule giving another verdict, and the rule of another tier, disagree too
    for decided_by, verdict in (
        (accepted("x", "from-y", "ingress"), "deny"),
        (accepted("x", "from-y", "ingress") | {"tier": "Admin"}, "allow"),
    ):
        wrong = flow("ingress", "n1", verdict, decided_by)
        assert checked_answer(explanation, "connected", wrong).rules[1].judgement == DISAGREES


def test_a_probe_without_records_is_not_checked_and_the_verification_stands() -> None:
    explanation = explain(world((policy("x", "deny", ISOLATE_WEB),)), WEB_0, 8080)
    answer = checked_answer(explanation, "timed out")
    egress, ingress = answer.rules
    assert (egress.judgement, egress.unrecorded) == (NOT_CHECKED, True)
    assert egress.why == "no pod chain judges it, so nothing is recorded (no policy selects " \
        "y/client for egress: not isolated)"  # fmt: skip
    assert (ingress.judgement, ingress.unrecorded) == (NOT_CHECKED, False)
    assert answer.rule == NOT_CHECKED
    verification = Verification("knit-verify-3", (answer,), ())
    assert verification.agrees, "what could not be checked does not fail it"
    text = verification_text(verification)
    assert "           ingress on n1: rule not checked: no record on n1" in text
    assert "the kernel agrees (1 of 1 probes; deciding rule: 1 not checked)" in text
    shown = verification_json(verification)["probes"][0]
    assert shown["rule"] == "not checked" and shown["rules"][1]["reason"].startswith("no record")
    # a node whose records cannot be read, and records whose rule changed before their reading
    unread = checked_answer(explanation, "timed out", n1="no /run/knit/flows.sock")
    assert unread.rules[1].why == "n1's records: no /run/knit/flows.sock"
    changed = flow(
        "ingress", "n1", "deny", decided("Unknown", "the pod's rules have changed since")
    )
    assert checked_answer(explanation, "timed out", changed).rules[1].why == (
        "its records' rule changed before the daemon read them"
    )
    # the recorded isolation agrees; the egress no chain judges is rightly absent
    recorded = checked_answer(
        explanation, "timed out", flow("ingress", "n1", "deny", isolated("deny"))
    )
    assert recorded.rule == AGREES


def test_nothing_is_recorded_where_no_policy_judges_and_an_unreached_ingress() -> None:
    nothing = checked_answer(explain(world(), WEB_0, 8080), "connected")
    assert [(c.judgement, c.unrecorded) for c in nothing.rules] == [(NOT_CHECKED, True)] * 2
    assert nothing.rule == NOT_CHECKED, "no record says nothing either way"
    only_dns = {"podSelector": {}, "policyTypes": ["Egress"],
                "egress": [{"ports": [{"port": 53, "protocol": "UDP"}]}]}  # fmt: skip
    explanation = explain(world((policy("y", "only-dns", only_dns),)), WEB_0, 8080)
    denied = flow("egress", "n2", "deny", decided(
        "NetworkPolicy", "isolated by NetworkPolicy only-dns; no rule allows", namespace="y",
        name="only-dns", tier="NetworkPolicy"))  # fmt: skip
    answer = checked_answer(explanation, "timed out", denied, denied)
    assert [c.judgement for c in answer.rules] == [AGREES, NOT_CHECKED]
    assert answer.rules[1].why == "egress drops it first, so nothing is recorded"
    assert answer.rule == AGREES


def test_a_staged_decision_in_a_record_is_not_taken_for_the_enforced_one() -> None:
    would_deny = {"verdict": "deny", "decidedBy": isolated("deny-all")}
    # a staged default-deny: the pod's chain only logs, and its records allow by default
    staged_world = world((staged(policy("x", "deny-all", DENY_ALL)),))
    allowed = explain(staged_world, WEB_0, 8080)
    record = flow("ingress", "n1", "allow", NOT_ISOLATED, staged=would_deny)
    answer = checked_answer(allowed, "connected", record)
    assert [c.judgement for c in answer.rules] == [NOT_CHECKED, AGREES]
    assert answer.rule == AGREES, "the Default's words differ; the rule is the same"
    # enforced, the default-deny denies: a record that only a staged policy would deny
    # disagrees with it
    denied = explain(world((policy("x", "deny-all", DENY_ALL),)), WEB_0, 8080)
    assert checked_answer(denied, "timed out", record).rule == DISAGREES
    # a staged allow of what is denied: the record's enforced deny agrees
    would_allow = {"verdict": "allow", "decidedBy": accepted("x", "from-y", "ingress")}
    record = flow("ingress", "n1", "deny", isolated("deny-all"), staged=would_allow)
    assert checked_answer(denied, "timed out", record).rule == AGREES


def test_a_service_frontends_records_are_left_to_its_endpoints_probes() -> None:
    the_world = world(ALLOWED_BOTH_WAYS, services=(service({}),), endpoints=READY[:1])
    explanation = explain(the_world, ServiceTarget("x", "web"), 80)
    records = Records(SINCE, (flow("ingress", "n1", "allow", accepted("x", "from-y", "ingress")),))
    endpoint, frontend = (
        checked(explanation, Answer(p, "connected"), records) for p in probes(explanation)[0]
    )
    assert endpoint.rules[1].judgement == AGREES
    assert frontend.rules == () and frontend.rule == NOT_CHECKED
    text = verification_text(Verification("knit-verify-4", (endpoint, frontend), ()))
    assert "rule not checked: the proxy picks the endpoint, whose probe checks it" in text


def test_verify_reads_the_source_pods_records_from_the_judging_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    explanation = explain(world(ALLOWED_BOTH_WAYS), WEB_0, 8080)
    asked: dict[str, list[str]] = {}

    def read_nodes(commands: dict[str, list[str]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
        asked.update(commands)
        return [flow("ingress", "n1", "allow", accepted("x", "from-y", "ingress"))], {}

    def run(*_: object) -> tuple[str, list[Answer]]:
        return "knit-verify-5", [Answer(p, "connected") for p in probes(explanation)[0]]

    monkeypatch.setattr(probe, "run", run)
    monkeypatch.setattr(flows, "kubectl", lambda: "/bin/kubectl")
    monkeypatch.setattr(cli, "knit_pods", lambda *_: {"n1": "knit-a", "n3": "knit-c"})
    monkeypatch.setattr(flows, "read_nodes", read_nodes)
    monkeypatch.setattr(time, "time", lambda: SINCE)
    verification = cli._verified(None, explanation, probe.IMAGE, "/k.yaml")  # type: ignore[arg-type]
    assert list(asked) == ["n1"], "n3 judges nothing here; n2 has no knit pod"
    assert asked["n1"][-4:] == ["-o", "json", "--pod", "y/client"]
    (answer,) = verification.answers
    assert [c.judgement for c in answer.rules] == [NOT_CHECKED, AGREES]
    assert answer.rules[0].why == "n2's records: no running knit pod in kube-system"
    assert verification.agrees and verification.pod == "knit-verify-5"
