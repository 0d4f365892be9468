"""Staged policies: the annotation read so that nothing hostile opens policy, the compile split
(enforced: as if the staged objects did not exist; the staged view: as if they were
enforced), the chains that only log for pods only staged policies select, and what a flow
record and the daemon make of them."""

from __future__ import annotations

import dataclasses
import random
from ipaddress import ip_address
from typing import Any

import pytest

from proxyd.metrics import Metrics
from proxyd.nftables.kernel import Nft
from proxyd.policy.cluster_model import parse_cluster_policy
from proxyd.policy.compile import ALLOW, DROP, Cluster, compile_family
from proxyd.policy.decided import DEFAULT, decided_by
from proxyd.policy.enforcer import PolicyEnforcer
from proxyd.policy.flows import UNKNOWN, PodIndex, ViewJudge, resolve
from proxyd.policy.model import EGRESS, INGRESS, Pod, parse_policy
from proxyd.policy.recorder import Recorder
from proxyd.policy.render import Renderer
from proxyd.policy.staged import changes, observed
from proxyd.policy.state import PolicyState
from proxyd.policy.verdict import Connection, Judge
from tests.support.logged_packets import EVERY_VERDICT, PREFIX, logged
from tests.support.nft_fake import applied
from tests.support.nft_trace import FORWARDED, Packet, trace
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


# ------------------------------------------------------------ the chains that only log


@pytest.mark.parametrize("seed", range(40))
def test_observing_chains_change_no_verdict_and_records_say_what_the_view_would_decide(
    seed: int,
) -> None:
    """Every connection between the random pods, traced through the rendered rules: the
    table with the observing chains gives the verdict the enforced table alone gives, logs
    every connection either the enforced table or the view judges, and each record carries
    a staged decision exactly when the view decides otherwise."""
    cluster = random_staged_cluster(seed)
    enforced = compile_family(cluster, 4, provenance=True)
    view = compile_family(cluster, 4, provenance=True, staged_view=True)
    written = observed(enforced, view)
    alone = applied([Renderer(4).full(enforced, replacing=False)])
    ruleset = applied([Renderer(4, EVERY_VERDICT).full(written, replacing=False)])
    enforced_judge, view_judge, judges = Judge(enforced), Judge(view), ViewJudge()
    addresses = [p.addresses[0] for p in cluster.pods.values()]
    for source in addresses:
        for destination in addresses:
            for protocol, port in (("tcp", 80), ("udp", 8080)):
                packet = Packet(source, destination, port, protocol=protocol)
                traced = trace(ruleset, packet, FORWARDED)
                assert traced.verdict == trace(alone, packet, FORWARDED).verdict
                (outcome,) = traced.outcomes
                prefixes = [m for rule in outcome.visited for m in PREFIX.findall(rule)]
                connection = Connection(source, destination, protocol, port)
                for text in prefixes:
                    record = resolve(
                        logged(text, source, destination, port, protocol),
                        "n1", written, cluster.pods, PodIndex(), (view, judges),
                    )  # fmt: skip
                    direction = INGRESS if text.startswith("ingress") else EGRESS
                    would = view_judge.decide(direction, connection)
                    assert would is not None, "the view judges what the table logs"
                    was = enforced_judge.decide(direction, connection)
                    if was is None:
                        assert record.decided_by.kind == DEFAULT and record.allowed
                    wanted = (would.allowed, decided_by(would.decided_by, view, direction))
                    if changes((record.allowed, record.decided_by), wanted):
                        assert record.staged is not None
                        assert (record.staged.allowed, record.staged.decided_by) == wanted
                    else:
                        assert record.staged is None
                judged = [
                    d for d in (EGRESS, INGRESS) if view_judge.decide(d, connection) is not None
                ]
                if source != destination and judged and enforced_judge.allows(connection):
                    assert len(prefixes) == len(judged), "each judging chain logs"


def test_a_staged_default_deny_gives_an_unpoliced_pod_a_chain_that_logs_and_allows() -> None:
    staged = parse_policy(policy_object(DENY_ALL, STAGED, name="deny-all"))
    cluster = Cluster.of("n1", PODS, NAMESPACES, (staged,))
    enforced = compile_family(cluster, 4, provenance=True)
    assert enforced.chains == {} and observed(enforced, enforced) is enforced
    view = compile_family(cluster, 4, provenance=True, staged_view=True)
    written = observed(enforced, view)
    chain = written.ingress[WEB]
    assert written.chains[chain].matches == () and written.chains[chain].otherwise == ALLOW
    assert written.owners[chain] == ("x", "web") and chain not in written.isolating
    record = resolve(
        logged(f"{chain} end allow", CLIENT, WEB, 80), "n1", written, cluster.pods, PodIndex(),
        (view, ViewJudge()),
    )  # fmt: skip
    assert record.allowed and record.decided_by.kind == DEFAULT
    assert record.staged is not None and not record.staged.allowed
    out = record.to_json()["staged"]
    assert out["verdict"] == "deny"
    assert (out["decidedBy"]["kind"], out["decidedBy"]["name"]) == ("NetworkPolicy", "deny-all")
    unknown = resolve(
        logged(f"{chain} 3 allow", CLIENT, WEB, 80), "n1", written, cluster.pods, PodIndex(),
        (view, ViewJudge()),
    )  # fmt: skip
    assert unknown.decided_by.kind == UNKNOWN and unknown.staged is None
    assert (
        resolve(
            logged(f"{chain} end allow", CLIENT, WEB, 80), "n1", written, cluster.pods, PodIndex()
        ).to_json()["staged"]
        is None
    ), "no view: no policy is staged"


def staged_sample(
    metrics: Metrics, verdict: str, name: str = "deny-all", kind: str = "NetworkPolicy"
) -> float:
    labels = {"kind": kind, "namespace": "x", "name": name, "verdict": verdict}
    value = metrics.registry.get_sample_value(
        "knit_network_policy_staged_connections_total", labels
    )
    return value or 0.0


def test_the_recorder_counts_staged_decisions_per_policy_and_would_be_verdict() -> None:
    allowing = {
        "podSelector": {"matchLabels": {"app": "web"}},
        "ingress": [{"from": [from_namespace("y")]}],
    }
    policies = (
        parse_policy(policy_object(allowing, name="from-y")),
        parse_policy(policy_object(DENY_ALL, STAGED, name="deny-all")),
    )
    cluster = Cluster.of("n1", PODS, NAMESPACES, policies)
    written = compile_family(cluster, 4, provenance=True)
    view = compile_family(cluster, 4, provenance=True, staged_view=True)
    metrics = Metrics()
    recorder = Recorder("n1", lambda _: (written, view, cluster.pods), metrics, True, 0)
    web, other = written.ingress[WEB], written.ingress.get(OTHER)
    assert other is None and OTHER in observed(written, view).ingress
    recorder.report(logged(f"{web} 0 allow", CLIENT, WEB, 80))
    recorder.report(logged(f"{web} end drop", OTHER, WEB, 80))
    assert recorder.ring is not None
    items, _ = recorder.ring.after(-1)
    assert [item["staged"] for item in items] == [None, None], (
        "from-y decides both with deny-all enforced too: it changes nothing"
    )
    written = observed(written, view)
    other = written.ingress[OTHER]
    recorder = Recorder("n1", lambda _: (written, view, cluster.pods), metrics, True, 0)
    for _ in range(2):
        recorder.report(logged(f"{other} end allow", CLIENT, OTHER, 80))
    assert staged_sample(metrics, "deny") == 2 and staged_sample(metrics, "allow") == 0


# ------------------------------------------------------------ the daemon


def pod_object(name: str, address: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "x", "name": name, "uid": name, "labels": labels},
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "podIPs": [{"ip": address}]},
    }


@pytest.mark.parametrize("records", [False, True])
def test_the_daemon_writes_no_staged_verdict_and_logs_for_it_only_with_records(
    monkeypatch: pytest.MonkeyPatch, records: bool
) -> None:
    loaded: list[str] = []
    monkeypatch.setattr(Nft, "run", lambda nft, text: loaded.append(text))
    monkeypatch.setattr(Nft, "rehearse", lambda nft, text: None)
    monkeypatch.setattr(Nft, "exists", lambda nft: False)
    enforcer = PolicyEnforcer("n1", (4,), 3600.0, Metrics(), flow_rate=10 if records else 0)
    state = enforcer.state
    state.replace_namespaces([{"metadata": {"name": "x"}}])
    state.replace_pods([pod_object("web", WEB, {"app": "web"})])
    state.replace_policies([policy_object(DENY_ALL, STAGED, name="deny-all")])
    state.replace_cluster_policies([])
    enforcer.sync()
    written, view, _ = enforcer.table(4)
    assert written is not None
    chains = [
        line for line in loaded[-1].splitlines() if "add chain ip knit-policy ingress" in line
    ]
    if records:
        assert view is not None and view.chains[view.ingress[WEB]].otherwise == DROP
        assert written.chains[written.ingress[WEB]].otherwise == ALLOW
        assert len(chains) == 1
    else:
        assert view is None and written.chains == {} and chains == []
    assert not Judge(written).decide(INGRESS, Connection(CLIENT, WEB, "tcp", 80)) or records
    state.policy_event("MODIFIED", policy_object(DENY_ALL, {}, name="deny-all"))
    enforcer.sync()
    written, view, _ = enforcer.table(4)
    assert view is None, "no policy is staged"
    assert written is not None and not Judge(written).allows(Connection(CLIENT, WEB, "tcp", 80))
    enforcer.stop()
