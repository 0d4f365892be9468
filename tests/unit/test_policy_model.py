"""NetworkPolicy parsing: the API reference's defaults, and narrowing what cannot be read."""

from __future__ import annotations

from typing import Any

import pytest

from proxyd.model import InvalidObject
from proxyd.policy.model import (
    EGRESS,
    EVERYTHING,
    INGRESS,
    IpBlock,
    PortMatch,
    parse_pod,
    parse_policy,
    parse_selector,
    pod_essentials,
)


def policy(spec: Any) -> dict[str, Any]:
    return {"metadata": {"namespace": "ns", "name": "p"}, "spec": spec}


@pytest.mark.parametrize(
    ("spec", "directions"),
    [
        ({"podSelector": {}}, {INGRESS}),
        ({"podSelector": {}, "egress": []}, {INGRESS, EGRESS}),
        ({"podSelector": {}, "policyTypes": ["Egress"]}, {EGRESS}),
        ({"podSelector": {}, "policyTypes": []}, {INGRESS}),
    ],
)
def test_policy_types_default_as_the_api_says(spec: dict[str, Any], directions: set[str]) -> None:
    assert parse_policy(policy(spec)).directions == directions


def test_empty_rule_lists_allow_nothing_and_empty_rules_anything() -> None:
    parsed = parse_policy(policy({"podSelector": {}, "ingress": [{}], "policyTypes": ["Ingress"]}))
    assert [(r.peers, r.ports) for r in parsed.ingress] == [(None, None)]
    assert parse_policy(policy({"podSelector": {}, "ingress": []})).ingress == ()


def test_selectors_match_labels_and_expressions() -> None:
    selector = parse_selector(
        {
            "matchLabels": {"app": "web"},
            "matchExpressions": [
                {"key": "tier", "operator": "NotIn", "values": ["db"]},
                {"key": "team", "operator": "Exists"},
                {"key": "legacy", "operator": "DoesNotExist"},
            ],
        },
        "s",
    )
    assert selector.matches({"app": "web", "team": "a"})
    assert not selector.matches({"app": "web", "team": "a", "tier": "db"})
    assert not selector.matches({"app": "web"})
    assert not selector.matches({"app": "web", "team": "a", "legacy": ""})
    assert EVERYTHING.matches({})


@pytest.mark.parametrize(
    "rule",
    [
        {"from": [{"ipBlock": {"cidr": "not-a-cidr"}}]},
        {"from": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["192.168.0.0/16"]}}]},
        {"from": [{"podSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}}]},
        {"from": [{}]},
        {"ports": [{"port": 70000}]},
        {"ports": [{"port": "web", "endPort": 90}]},
        {"ports": [{"port": 90, "endPort": 80}]},
        {"ports": [{"port": 80, "protocol": "ICMP"}]},
    ],
)
def test_a_rule_that_cannot_be_read_is_left_out_whole(rule: dict[str, Any]) -> None:
    """Dropping only the bad peer or port would leave an empty list, which means any."""
    parsed = parse_policy(
        policy({"podSelector": {}, "ingress": [rule, {"ports": [{"port": 53, "protocol": "UDP"}]}]})
    )
    assert INGRESS in parsed.directions
    assert [r.ports for r in parsed.ingress] == [(PortMatch("UDP", 53, None),)]
    # the rule after it keeps its place in the object, as explain names it
    assert [r.index for r in parsed.ingress] == [1]
    assert parsed.problems and parsed.problems[0].startswith("ingress[0] left out")


def test_a_policy_whose_selector_cannot_be_read_isolates_its_whole_namespace() -> None:
    parsed = parse_policy(
        policy({"podSelector": {"matchLabels": {"a": 1}}, "ingress": [{}], "egress": [{}]})
    )
    assert parsed.pods == EVERYTHING
    assert parsed.directions == {INGRESS, EGRESS}
    assert parsed.ingress == parsed.egress == ()


def test_ip_block_and_port_range() -> None:
    parsed = parse_policy(
        policy(
            {
                "podSelector": {},
                "egress": [
                    {
                        "to": [{"ipBlock": {"cidr": "10.1.2.3/16", "except": ["10.1.9.0/24"]}}],
                        "ports": [{"port": 8000, "endPort": 8100}],
                    }
                ],
            }
        )
    )
    (rule,) = parsed.egress
    assert rule.peers is not None and rule.peers[0].block == IpBlock(
        "10.1.0.0/16", ("10.1.9.0/24",)
    )
    assert rule.ports == (PortMatch("TCP", 8000, 8100),)


def test_pods_outside_policy_scope_are_left_out() -> None:
    base = {
        "metadata": {"namespace": "ns", "name": "p", "labels": {"a": "b"}},
        "spec": {
            "nodeName": "n",
            "containers": [{"ports": [{"name": "web", "containerPort": 8080}]}],
        },
        "status": {"podIPs": [{"ip": "10.0.0.1"}, {"ip": "fd00::1"}]},
    }
    pod = parse_pod(base)
    assert pod is not None and pod.addresses == ("10.0.0.1", "fd00::1")
    assert pod.port_named("web", "TCP") == 8080 and pod.port_named("web", "UDP") is None
    assert parse_pod({**base, "spec": {"hostNetwork": True}}) is None
    assert (
        parse_pod({**base, "status": {"phase": "Succeeded", "podIPs": [{"ip": "10.0.0.1"}]}})
        is None
    )
    assert parse_pod({**base, "status": {}}) is None
    with pytest.raises(InvalidObject):
        parse_pod({**base, "status": {"podIPs": [{"ip": "nope"}]}})


def test_a_pod_trimmed_as_its_list_page_arrives_parses_the_same() -> None:
    full = {
        "metadata": {
            "namespace": "ns",
            "name": "web-0",
            "labels": {"app": "web"},
            "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}] * 20,
            "annotations": {"a": "b" * 1000},
        },
        "spec": {
            "nodeName": "n1",
            "volumes": [{"name": "v"}] * 10,
            "containers": [
                {"name": "c", "image": "x", "ports": [{"name": "web", "containerPort": 80}]}
            ],
            "initContainers": [
                {"name": "i", "ports": [{"name": "dns", "containerPort": 53, "protocol": "UDP"}]}
            ],
        },
        "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.1"}], "conditions": [{}] * 5},
    }
    trimmed = pod_essentials(full)
    assert parse_pod(trimmed) == parse_pod(full) is not None
    assert "managedFields" not in trimmed["metadata"] and "volumes" not in trimmed["spec"]


def test_policy_state_skips_objects_not_in_the_api_shape() -> None:
    from proxyd.policy.state import PolicyState

    state = PolicyState("n1")
    state.replace_namespaces(
        [{"metadata": {"name": "ns", "labels": ["x"]}}, {"metadata": {"name": "ok"}}]
    )
    state.replace_pods([{"metadata": {"namespace": "ns", "name": "p"}, "spec": "x", "status": {}}])
    state.replace_policies([policy({"podSelector": {}, "ingress": "everything"})])
    cluster, _ = state.take()
    assert list(cluster.namespaces) == ["ok"] and not cluster.pods
    (parsed,) = cluster.policies
    assert parsed.ingress == () and parsed.problems


def test_policy_state_snapshots_keep_their_pod_views_while_pods_change() -> None:
    """Each snapshot's pods by namespace and pods of this node are what its pods say, even
    after later changes (the state hands out a namespace's dict and copies it when it next
    changes)."""
    import random

    from proxyd.policy.compile import Cluster
    from proxyd.policy.state import PolicyState

    def pod_obj(namespace: str, name: str, node: str) -> dict[str, Any]:
        return {
            "metadata": {"namespace": namespace, "name": name, "uid": name},
            "spec": {"nodeName": node},
            "status": {"phase": "Running", "podIPs": [{"ip": "10.0.0.1"}]},
        }

    rng = random.Random(3)
    state = PolicyState("n1")
    state.replace_pods([pod_obj(f"ns{i % 3}", f"p{i}", f"n{i % 2}") for i in range(12)])
    snapshots = []
    for _ in range(40):
        name = f"p{rng.randrange(16)}"
        if rng.random() < 0.3:
            state.pod_event("DELETED", pod_obj("ns0", name, "n1"))
            state.pod_event("DELETED", pod_obj("ns1", name, "n1"))
        else:
            state.pod_event(
                "MODIFIED", pod_obj(f"ns{rng.randrange(3)}", name, f"n{rng.randrange(2)}")
            )
        if rng.random() < 0.4:
            snapshots.append(state.take()[0])
    snapshots.append(state.take()[0])
    for cluster in snapshots:
        made = Cluster.of(cluster.node, cluster.pods, cluster.namespaces, cluster.policies)
        assert cluster.by_namespace == made.by_namespace
        assert cluster.local == made.local


def test_policy_state_lets_a_list_go_before_it_queues_the_sync() -> None:
    """The watch's objects are freed before the sync is queued, not while it runs."""
    from proxyd.policy.state import PolicyState

    objs: list[dict[str, Any]] = [
        {
            "metadata": {"namespace": "ns", "name": f"p{i}"},
            "spec": {"nodeName": "n1"},
            "status": {"phase": "Running", "podIPs": [{"ip": f"10.0.0.{i}"}]},
        }
        for i in range(1, 4)
    ]
    held_at_change: list[int] = []
    state = PolicyState("n1", on_change=lambda: held_at_change.append(len(objs)))
    state.replace_pods(objs)
    assert held_at_change == [0]
    cluster, _ = state.take()
    assert len(cluster.pods) == 3
