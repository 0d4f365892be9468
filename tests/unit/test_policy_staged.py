"""Staged policies: the annotation read so that nothing hostile opens policy, and the compile
split (enforced: as if the staged objects did not exist; the staged view: as if they were
enforced)."""

from __future__ import annotations

import dataclasses
import random
from ipaddress import ip_address
from typing import Any

import pytest

from proxyd.policy.cluster_model import parse_cluster_policy
from proxyd.policy.compile import Cluster, compile_family
from proxyd.policy.model import EGRESS, INGRESS, Pod, parse_policy
from proxyd.policy.state import PolicyState
from tests.support.random_policies import NAMESPACES, from_namespace, random_objects

STAGED = {"knit.dev/staged": "true"}
WEB, OTHER, CLIENT = "10.0.0.1", "10.0.0.2", "10.0.1.1"
PODS = {
    (namespace, name): Pod(
        namespace, name, {"app": name}, node, (address,), (int(ip_address(address)),), {}
    )
    for namespace, name, node, address in (
        ("x", "web", "n1", WEB), ("x", "other", "n1", OTHER), ("y", "client", "n2", CLIENT),
    )
}  # fmt: skip
DENY_ALL = {"podSelector": {}, "policyTypes": ["Ingress"]}


def policy_object(
    spec: Any, annotations: Any = None, name: str = "p", namespace: str = "x"
) -> dict[str, Any]:
    meta: dict[str, Any] = {"namespace": namespace, "name": name}
    if annotations is not None:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": spec}


def cluster_policy_object(annotations: Any) -> dict[str, Any]:
    subject = {"namespaces": {}}
    rule = {"action": "Deny", "from": [{"namespaces": {}}]}
    spec = {"tier": "Admin", "priority": 1, "subject": subject, "ingress": [rule]}
    return {"metadata": {"name": "c", "annotations": annotations}, "spec": spec}


# ------------------------------------------------------------ the annotation


@pytest.mark.parametrize(
    ("annotations", "staged", "problem"),
    [
        (STAGED, True, None),
        (None, False, None),
        ({}, False, None),
        ({"knit.dev/staged": "false"}, False, None),
        ({"knit.dev/staged": "True"}, False, "'True', not 'true'"),
        ({"knit.dev/staged": "true "}, False, "'true ', not 'true'"),
        ({"knit.dev/staged": "yes"}, False, "'yes', not 'true'"),
        ({"knit.dev/staged": True}, False, "a bool, not 'true'"),
        ({"knit.dev/staged": ["true"]}, False, "a list, not 'true'"),
        ({"knit.dev/staged": "x" * 10_000}, False, "not staged, enforced"),
        (["knit.dev/staged=true"], False, "annotations is not an object"),
        ("true", False, "annotations is not an object"),
    ],
)
def test_only_the_annotation_true_stages_and_what_cannot_be_read_is_enforced(
    annotations: Any, staged: bool, problem: str | None
) -> None:
    for parse, obj in (
        (parse_policy, policy_object(DENY_ALL, annotations)),
        (parse_cluster_policy, cluster_policy_object(annotations)),
    ):
        parsed = parse(obj)
        assert parsed.staged is staged, (obj, parsed)
        if problem is None:
            assert parsed.problems == ()
        else:
            (said,) = parsed.problems
            assert problem in said and len(said) < 200, said


def test_a_staged_policy_keeps_its_rules_and_an_unreadable_one_still_isolates_staged() -> None:
    allowing = {"podSelector": {}, "ingress": [{"from": [from_namespace("y")]}]}
    staged = parse_policy(policy_object(allowing, STAGED))
    assert dataclasses.replace(staged, staged=False) == parse_policy(policy_object(allowing))
    assert staged != parse_policy(policy_object(allowing)), "a change of the annotation syncs"
    broken = parse_policy(policy_object({"podSelector": "all"}, STAGED))
    assert broken.staged and broken.directions == {INGRESS, EGRESS}


# ------------------------------------------------------------ the compile split


def without_staged(cluster: Cluster) -> Cluster:
    return Cluster.of(
        cluster.node,
        cluster.pods,
        cluster.namespaces,
        tuple(p for p in cluster.policies if not p.staged),
        tuple(p for p in cluster.cluster_policies if not p.staged),
    )


def all_enforced(cluster: Cluster) -> Cluster:
    return Cluster.of(
        cluster.node,
        cluster.pods,
        cluster.namespaces,
        tuple(dataclasses.replace(p, staged=False) for p in cluster.policies),
        tuple(dataclasses.replace(p, staged=False) for p in cluster.cluster_policies),
    )


def random_staged_cluster(seed: int) -> Cluster:
    rng = random.Random(4000 + seed)
    pods, policies, cluster_policies = random_objects(rng)
    return Cluster.of(
        "n1",
        {(p.namespace, p.name): p for p in pods},
        NAMESPACES,
        tuple(dataclasses.replace(p, staged=rng.random() < 0.5) for p in policies),
        tuple(dataclasses.replace(p, staged=rng.random() < 0.5) for p in cluster_policies),
    )


@pytest.mark.parametrize("seed", range(40))
def test_enforced_is_as_without_the_staged_objects_and_the_view_as_with_them_enforced(
    seed: int,
) -> None:
    cluster = random_staged_cluster(seed)
    for provenance in (False, True):
        assert compile_family(cluster, 4, provenance=provenance) == compile_family(
            without_staged(cluster), 4, provenance=provenance
        )
    view = compile_family(cluster, 4, provenance=True, staged_view=True)
    assert view == compile_family(all_enforced(cluster), 4, provenance=True)


def test_a_cluster_whose_staged_flag_is_not_set_enforces_its_staged_policies() -> None:
    staged = parse_policy(policy_object(DENY_ALL, STAGED))
    cluster = Cluster.of("n1", PODS, NAMESPACES, (staged,))
    assert cluster.staged and WEB not in compile_family(cluster, 4).ingress
    unflagged = dataclasses.replace(cluster, staged=False)
    assert WEB in compile_family(unflagged, 4).ingress, "never less protection"


def test_the_state_counts_staged_policies_as_they_change() -> None:
    state = PolicyState("n1")
    state.replace_policies([policy_object(DENY_ALL, STAGED, name="a")])
    state.replace_cluster_policies([])
    assert state.take()[0].staged
    state.policy_event("MODIFIED", policy_object(DENY_ALL, {}, name="a"))
    assert not state.take()[0].staged, "unstaged"
    state.cluster_policy_event("ADDED", cluster_policy_object(STAGED))
    state.policy_event("ADDED", policy_object(DENY_ALL, STAGED, name="b"))
    state.cluster_policy_event("DELETED", cluster_policy_object(STAGED))
    assert state.take()[0].staged
    state.policy_event("DELETED", policy_object(DENY_ALL, STAGED, name="b"))
    assert not state.take()[0].staged
