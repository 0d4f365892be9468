"""explain's verdict over random clusters equals the rendered rules of the two nodes traced
(tests/support/nft_trace.py): the source's node's table, then the destination's when the
destination is a pod of another node; and the bool verdict.Judge gives on the daemon's own
compile (without provenance) of those nodes."""

from __future__ import annotations

import dataclasses
import random

import pytest

from proxyd.explain.explain import AddressTarget, Explainer, Question, World
from proxyd.policy.compile import Cluster, compile_family
from proxyd.policy.render import Renderer
from proxyd.policy.verdict import Connection, Judge
from tests.support.nft_fake import Ruleset, applied
from tests.support.nft_trace import FORWARDED, Packet, trace
from tests.unit.test_policy_verdict import (
    NAMESPACES,
    OUTSIDE,
    random_cluster_policy,
    random_pods,
    random_policy,
)

PROTOCOL_PORTS = (("TCP", 80), ("TCP", 8080), ("TCP", 9090), ("UDP", 80))


def accepts(ruleset: Ruleset, source: str, destination: str, protocol: str, port: int) -> bool:
    packet = Packet(source, destination, port, protocol=protocol.lower())
    return trace(ruleset, packet, FORWARDED).verdict == "accept"


@pytest.mark.parametrize("seed", range(20))
def test_explain_agrees_with_both_nodes_rules_traced(seed: int) -> None:
    rng = random.Random(1000 + seed)
    pods = random_pods(rng)
    policies = tuple(random_policy(rng, i) for i in range(rng.randrange(1, 4)))
    cluster_policies = tuple(random_cluster_policy(rng, i) for i in range(rng.randrange(3)))
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
