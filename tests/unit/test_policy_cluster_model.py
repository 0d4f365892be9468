"""ClusterNetworkPolicy objects parsed, and narrowed the API's fail-closed way where knit
cannot read or does not implement a peer or protocol."""

from __future__ import annotations

from typing import Any

import pytest

from proxyd.model import InvalidObject
from proxyd.policy.cluster_model import (
    ACCEPT,
    ADMIN,
    BASELINE,
    DENY,
    DENY_ALL,
    PASS,
    ClusterRule,
    parse_cluster_policy,
)
from proxyd.policy.model import EVERYTHING, IpBlock, Peer, PortMatch, Requirement, Selector

TEAM = Selector((Requirement("team", "In", ("a",)),))


def cnp(spec: dict[str, Any]) -> dict[str, Any]:
    base = {"tier": "Admin", "priority": 10, "subject": {"namespaces": {}}}
    return {"metadata": {"name": "c"}, "spec": {**base, **spec}}


def test_a_policy_with_every_standard_field() -> None:
    parsed = parse_cluster_policy(
        cnp(
            {
                "tier": "Baseline",
                "priority": 1000,
                "subject": {
                    "pods": {"namespaceSelector": {"matchLabels": {"team": "a"}}, "podSelector": {}}
                },
                "ingress": [
                    {"name": "ns", "action": "Deny", "from": [{"namespaces": {}}]},
                    {
                        "action": "Accept",
                        "from": [{"pods": {"namespaceSelector": {}, "podSelector": {}}}],
                        "protocols": [
                            {"tcp": {"destinationPort": {"number": 80}}},
                            {"udp": {"destinationPort": {"range": {"start": 53, "end": 54}}}},
                            {"sctp": {}},
                            {"destinationNamedPort": "web"},
                        ],
                    },
                ],
                "egress": [{"action": "Pass", "to": [{"networks": ["10.0.0.0/8", "fd00::/8"]}]}],
            }
        )
    )
    assert (parsed.tier, parsed.priority) == (BASELINE, 1000)
    assert parsed.subject == Peer(EVERYTHING, TEAM)
    everyone = Peer(EVERYTHING, EVERYTHING)
    assert parsed.ingress == (
        ClusterRule(DENY, (everyone,), None, "ns"),
        ClusterRule(
            ACCEPT,
            (everyone,),
            (
                PortMatch("TCP", 80, 80),
                PortMatch("UDP", 53, 54),
                PortMatch("SCTP"),
                PortMatch("TCP", name="web"),
                PortMatch("UDP", name="web"),
                PortMatch("SCTP", name="web"),
            ),
        ),
    )
    blocks = (Peer(block=IpBlock("10.0.0.0/8")), Peer(block=IpBlock("fd00::/8")))
    assert parsed.egress == (ClusterRule(PASS, blocks, None),)
    assert not parsed.problems


@pytest.mark.parametrize("action", [DENY, PASS])
def test_a_peer_knit_does_not_implement_makes_a_deny_or_pass_rule_deny_all(action: str) -> None:
    rule = {"action": action, "to": [{"nodes": {}}, {"namespaces": {}}]}
    parsed = parse_cluster_policy(cnp({"egress": [rule]}))
    assert parsed.egress == (DENY_ALL,)
    assert "nodes peers are not implemented" in parsed.problems[0]


def test_an_accept_rule_does_not_match_through_a_peer_it_cannot_use() -> None:
    rules = [
        {"action": "Accept", "to": [{"domainNames": ["a.example"]}, {"namespaces": {}}]},
        {"action": "Accept", "to": [{"nodes": {}}]},
    ]
    parsed = parse_cluster_policy(cnp({"egress": rules}))
    assert parsed.egress == (ClusterRule(ACCEPT, (Peer(EVERYTHING, EVERYTHING),), None),)
    assert len(parsed.problems) == 2


def test_each_rule_keeps_its_place_in_the_object_when_one_before_it_is_left_out() -> None:
    rules = [
        {"action": "Accept", "to": [{"nodes": {}}]},  # matches nothing: left out
        {"action": "Deny", "to": [{"nodes": {}}]},  # denies everything
        {"action": "Accept", "to": [{"namespaces": {}}]},
    ]
    parsed = parse_cluster_policy(cnp({"egress": rules}))
    assert [(rule.action, rule.index) for rule in parsed.egress] == [(DENY, 1), (ACCEPT, 2)]


@pytest.mark.parametrize(
    "peer",
    [
        {},
        {"namespaces": {}, "pods": {"namespaceSelector": {}, "podSelector": {}}},
        {"networks": ["10.0.0.0/8"]},  # an egress peer only
        {"namespaces": {"matchExpressions": [{"key": "a", "operator": "Near"}]}},
    ],
)
def test_an_unreadable_ingress_peer_fails_closed(peer: dict[str, Any]) -> None:
    deny = parse_cluster_policy(cnp({"ingress": [{"action": "Deny", "from": [peer]}]}))
    assert deny.ingress == (DENY_ALL,)
    accept = parse_cluster_policy(cnp({"ingress": [{"action": "Accept", "from": [peer]}]}))
    assert accept.ingress == ()


@pytest.mark.parametrize(
    "protocol",
    [
        {"tcp": {"destinationPort": {"number": 0}}},
        {"tcp": {"destinationPort": {"range": {"start": 90, "end": 80}}}},
        {"icmp": {}},
        {"tcp": {}, "udp": {}},
    ],
)
def test_an_unreadable_protocol_fails_closed(protocol: dict[str, Any]) -> None:
    rule = {"from": [{"namespaces": {}}], "protocols": [protocol]}
    deny = parse_cluster_policy(cnp({"ingress": [{**rule, "action": "Pass"}]}))
    assert deny.ingress == (DENY_ALL,)
    accept = parse_cluster_policy(cnp({"ingress": [{**rule, "action": "Accept"}]}))
    assert accept.ingress == ()


@pytest.mark.parametrize(
    "spec",
    [
        {"tier": "Developer"},
        {"priority": 1001},
        {"priority": "1"},
        {"subject": {}},
        {"subject": {"nodes": {}}},
    ],
)
def test_a_policy_whose_subject_tier_or_priority_is_unreadable_is_refused(
    spec: dict[str, Any],
) -> None:
    with pytest.raises(InvalidObject):
        parse_cluster_policy(cnp(spec))


def test_an_admin_policy_with_an_unknown_action_denies() -> None:
    parsed = parse_cluster_policy(
        cnp({"ingress": [{"action": "Allow", "from": [{"namespaces": {}}]}]})
    )
    assert parsed.tier == ADMIN
    assert parsed.ingress == (DENY_ALL,)
