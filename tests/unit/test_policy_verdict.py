"""Judging a connection by the compiled policy (pure), checked against the rendered rules
traced (tests/support/nft_trace.py) over random clusters, as `kubectl knit explain` judges it
on two nodes too, and which conntrack entries a policy change cuts: the kernel's side is
tests/integration/test_network_policy.py."""

from __future__ import annotations

import dataclasses
import ipaddress
import random
from typing import Any

import pytest

from proxyd.conntrack import Flow
from proxyd.explain.explain import AddressTarget, Explainer, Question, World
from proxyd.policy.cluster_model import parse_cluster_policy
from proxyd.policy.compile import ALLOW, DROP, NEXT, Cluster, FamilyPolicy, compile_family
from proxyd.policy.cutter import denied, misjudged
from proxyd.policy.model import EGRESS, INGRESS, NetworkPolicy, Pod, parse_policy
from proxyd.policy.quarantine import quarantined
from proxyd.policy.render import CUT_MARK, Renderer
from proxyd.policy.verdict import Connection, Judge
from tests.support.nft_fake import Ruleset, applied
from tests.support.nft_trace import FORWARDED, Packet, trace
from tests.support.random_policies import NAMESPACES, from_namespace, random_objects

WEB, OTHER, CLIENT, OUTSIDE = "10.0.0.1", "10.0.0.2", "10.0.1.1", "192.0.2.7"


def pod(ns: str, name: str, ip: str, node: str = "n1", **ports: int) -> Pod:
    named = {(k, "TCP"): v for k, v in ports.items()}
    address = int(ipaddress.ip_address(ip))
    return Pod(ns, name, {"app": name}, node, (ip,), (address,), named)


PODS = [
    pod("x", "web", WEB, web=8080),
    pod("x", "other", OTHER),
    pod("y", "client", CLIENT, node="n2", web=9090),
]


def policy(ns: str, spec: dict[str, Any]) -> NetworkPolicy:
    return parse_policy({"metadata": {"namespace": ns, "name": "p"}, "spec": spec})


def compiled(*policies: NetworkPolicy, cluster_policies: tuple[Any, ...] = ()) -> FamilyPolicy:
    cluster = Cluster.of("n1", {(p.namespace, p.name): p for p in PODS}, NAMESPACES, policies)
    return compile_family(dataclasses.replace(cluster, cluster_policies=cluster_policies), 4)


def tcp(source: str, destination: str, port: int) -> Connection:
    return Connection(source, destination, "tcp", port)


def test_an_isolated_pod_is_reached_only_from_allowed_peers_on_allowed_ports() -> None:
    spec = {
        "podSelector": {"matchLabels": {"app": "web"}},
        "ingress": [{"from": [from_namespace("y")], "ports": [{"port": "web"}]}],
    }
    judge = Judge(compiled(policy("x", spec)))
    assert judge.allows(tcp(CLIENT, WEB, 8080))
    assert not judge.allows(tcp(CLIENT, WEB, 80))
    assert not judge.allows(tcp(OTHER, WEB, 8080))
    assert not judge.allows(Connection(CLIENT, WEB, "udp", 8080))
    assert not judge.judges(tcp(CLIENT, OTHER, 80)), "the other pod is not isolated"
    assert judge.allows(tcp(WEB, WEB, 80)), "a pod's traffic to itself"


def test_egress_to_a_named_port_resolves_on_the_peer() -> None:
    spec = {
        "podSelector": {"matchLabels": {"app": "web"}},
        "policyTypes": ["Egress"],
        "egress": [{"ports": [{"port": "web"}]}],
    }
    judge = Judge(compiled(policy("x", spec)))
    assert judge.allows(tcp(WEB, CLIENT, 9090))
    assert not judge.allows(tcp(WEB, CLIENT, 8080))
    assert not judge.allows(tcp(WEB, OUTSIDE, 9090)), "no pod of that address names the port"


def test_an_ip_block_with_an_except() -> None:
    spec = {
        "podSelector": {},
        "ingress": [{"from": [{"ipBlock": {"cidr": "192.0.2.0/24", "except": ["192.0.2.7/32"]}}]}],
    }
    judge = Judge(compiled(policy("x", spec)))
    assert judge.allows(tcp("192.0.2.8", WEB, 80))
    assert not judge.allows(tcp(OUTSIDE, WEB, 80))


def cluster_policy(name: str, priority: int, action: str) -> Any:
    subject = {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "web"}}}}
    rules = [{"action": action, "from": [{"namespaces": from_namespace("y")["namespaceSelector"]}]}]
    spec = {"tier": "Admin", "priority": priority, "subject": subject, "ingress": rules}
    return parse_cluster_policy({"metadata": {"name": name}, "spec": spec})


def test_an_admin_deny_beats_a_networkpolicy_allow_and_a_pass_leaves_it_to_them() -> None:
    allow_all = policy("x", {"podSelector": {}, "ingress": [{}]})
    deny = Judge(compiled(allow_all, cluster_policies=(cluster_policy("deny", 1, "Deny"),)))
    assert not deny.allows(tcp(CLIENT, WEB, 80))
    assert deny.allows(tcp(OTHER, WEB, 80))
    passing = (cluster_policy("pass", 1, "Pass"), cluster_policy("deny", 2, "Deny"))
    assert Judge(compiled(allow_all, cluster_policies=passing)).allows(tcp(CLIENT, WEB, 80))
    isolating = policy("x", {"podSelector": {}, "ingress": []})
    assert not Judge(compiled(isolating, cluster_policies=passing)).allows(tcp(CLIENT, WEB, 80))


def test_decide_names_the_deciding_rule_and_each_pass_before_it() -> None:
    allow_all = policy("x", {"podSelector": {}, "ingress": [{}]})
    passing = (cluster_policy("pass", 1, "Pass"), cluster_policy("deny", 2, "Deny"))
    table = compile_family(
        dataclasses.replace(
            Cluster.of("n1", {(p.namespace, p.name): p for p in PODS}, NAMESPACES, (allow_all,)),
            cluster_policies=passing,
        ),
        4,
        provenance=True,
    )
    decision = Judge(table).decide(INGRESS, tcp(CLIENT, WEB, 80))
    assert decision is not None and decision.allowed
    passed, decided = decision.path
    assert passed.verdict == NEXT and passed.origin is not None
    assert (passed.origin.name, passed.origin.tier, passed.origin.priority) == ("pass", "Admin", 1)
    assert decided.origin is not None
    assert (decided.origin.kind, decided.origin.namespace, decided.origin.name) == (
        "NetworkPolicy", "x", "p",
    )  # fmt: skip
    assert Judge(table).decide(EGRESS, tcp(WEB, CLIENT, 80)) is None, "egress is not judged"


def test_a_quarantined_pod_is_reached_by_nothing() -> None:
    table = compiled(policy("x", {"podSelector": {}, "ingress": [{}]}))
    held = quarantined(table, {table.ingress[WEB]})
    assert Judge(table).allows(tcp(CLIENT, WEB, 80))
    assert not Judge(held).allows(tcp(CLIENT, WEB, 80))


def flow(source: str, destination: str, port: int = 80, mark: int = 0) -> Flow:
    return Flow("tcp", (source, 40000), (destination, port), mark, b"")


def test_a_change_cuts_the_entries_it_denies_and_never_the_nodes_own() -> None:
    cut = denied(Judge(compiled(policy("x", {"podSelector": {}, "ingress": []}))), ["10.0.0.254"])
    assert cut(flow(CLIENT, WEB)), "a connection from another node's pod"
    assert not cut(flow("10.0.0.254", WEB)), "the node's own connection crosses no forward hook"
    assert not cut(flow(WEB, CLIENT)), "the pods' egress is not isolated"
    # a Service connection is judged by where it went: the entry's reply source
    assert cut(flow(CLIENT, OTHER, 8080))


def test_only_entries_whose_mark_disagrees_with_the_table_are_changed() -> None:
    wrong = misjudged(denied(Judge(compiled(policy("x", {"podSelector": {}}))), []))
    assert wrong(flow(CLIENT, WEB)), "denied, not cut yet"
    assert not wrong(flow(CLIENT, WEB, mark=CUT_MARK | 7)), "denied and cut already"
    assert wrong(flow(WEB, CLIENT, mark=CUT_MARK)), "cut, and allowed again"
    assert not wrong(flow(WEB, CLIENT, mark=7)), "allowed, with another's mark bits"


# ------------------------------------------------------------ against the rendered rules

ACTION_VERDICTS = {"Accept": ALLOW, "Deny": DROP, "Pass": NEXT}


def decided(judge: Judge, connection: Connection) -> bool:
    """The verdict by `decide`, each direction's decision checked on the way: the deciding
    rule's action is its verdict, and a chain's end drops only where NetworkPolicies isolate
    the pod."""
    if connection.source == connection.destination and connection.source in judge.policy.local:
        return True
    decisions = [judge.decide(direction, connection) for direction in (EGRESS, INGRESS)]
    for decision in filter(None, decisions):
        for step in decision.path:
            if step.index is not None:
                assert step.origin is not None
                assert ACTION_VERDICTS[step.origin.action] == step.verdict or (
                    step.origin.action == "Pass" and step.origin.tier == "Baseline"
                ), step
            elif step.verdict == DROP:
                first = judge.policy.chains[step.chain].counter
                assert judge.policy.isolated_by[first], step
    return all(decision is None or decision.allowed for decision in decisions)


@pytest.mark.parametrize("seed", range(25))
def test_the_judge_agrees_with_the_rendered_rules_traced(seed: int) -> None:
    pods, policies, cluster_policies = random_objects(random.Random(seed))
    cluster = Cluster.of("n1", {(p.namespace, p.name): p for p in pods}, NAMESPACES, policies)
    cluster = dataclasses.replace(cluster, cluster_policies=cluster_policies)
    table = compile_family(cluster, 4)
    explained = compile_family(cluster, 4, provenance=True)
    assert dataclasses.replace(explained, isolated_by={}) == table, "provenance changes no rule"
    judge, explaining = Judge(table), Judge(explained)
    ruleset = applied([Renderer(4).full(table, replacing=False)])
    addresses = [p.addresses[0] for p in pods] + [OUTSIDE]
    for source in addresses:
        for destination in addresses:
            for protocol, port in (("tcp", 80), ("tcp", 8080), ("tcp", 9090), ("udp", 80)):
                connection = Connection(source, destination, protocol, port)
                packet = Packet(source, destination, port, protocol=protocol)
                traced = trace(ruleset, packet, FORWARDED).verdict == "accept"
                assert judge.allows(connection) == traced, (connection, policies)
                assert decided(explaining, connection) == traced, (connection, policies)


# ------------------------------------------------------------ explain, on two nodes

# explain's verdict over random clusters equals the rendered rules of the two nodes traced:
# the source's node's table, then the destination's when the destination is a pod of another
# node; and the bool verdict.Judge gives on the daemon's own compile (without provenance).

PROTOCOL_PORTS = (("TCP", 80), ("TCP", 8080), ("TCP", 9090), ("UDP", 80))


def accepts(ruleset: Ruleset, source: str, destination: str, protocol: str, port: int) -> bool:
    packet = Packet(source, destination, port, protocol=protocol.lower())
    return trace(ruleset, packet, FORWARDED).verdict == "accept"


@pytest.mark.parametrize("seed", range(20))
def test_explain_agrees_with_both_nodes_rules_traced(seed: int) -> None:
    pods, policies, cluster_policies = random_objects(random.Random(1000 + seed))
    by_key = {(p.namespace, p.name): p for p in pods}
    rulesets, judges = {}, {}
    for node in ("n1", "n2"):
        cluster = Cluster.of(node, by_key, NAMESPACES, policies)
        table = compile_family(dataclasses.replace(cluster, cluster_policies=cluster_policies), 4)
        rulesets[node] = applied([Renderer(4).full(table, replacing=False)])
        judges[node] = Judge(table)
    world = World(by_key, NAMESPACES, policies, cluster_policies, {}, {}, {})
    explainer = Explainer(world)
    for source in pods:
        for destination in [p.addresses[0] for p in pods] + [OUTSIDE]:
            receiver = next((p for p in pods if destination in p.addresses), None)
            for protocol, port in PROTOCOL_PORTS:
                question = Question(
                    (source.namespace, source.name), AddressTarget(destination), port, protocol
                )
                explanation = explainer.explain(question)
                address = source.addresses[0]
                traced = accepts(rulesets[source.node], address, destination, protocol, port)
                if receiver is not None and receiver.node != source.node:
                    traced = traced and accepts(
                        rulesets[receiver.node], address, destination, protocol, port
                    )
                case = (source.name, destination, protocol, port, policies, cluster_policies)
                assert explanation.allowed == traced, case
                connection = Connection(address, destination, protocol.lower(), port)
                nodes = {source.node} | ({receiver.node} if receiver is not None else set())
                judged = all(judges[node].allows(connection) for node in nodes)
                assert explanation.allowed == judged, case
