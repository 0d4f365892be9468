"""Random pods, NetworkPolicies and ClusterNetworkPolicies of two namespaces on two nodes,
small enough to trace every connection between them through the rendered rules
(tests/unit/test_policy_verdict.py, test_policy_flows.py)."""

from __future__ import annotations

import ipaddress
import random
from typing import Any

from proxyd.policy.cluster_model import ClusterNetworkPolicy, parse_cluster_policy
from proxyd.policy.model import Namespace, NetworkPolicy, Pod, parse_policy

NAMESPACES = {n: Namespace(n, {"kubernetes.io/metadata.name": n}) for n in ("x", "y")}


def from_namespace(name: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}}}


LABELS = ("a", "b", "c")
PORTS = (80, 8080, 9090)


def random_pods(rng: random.Random) -> list[Pod]:
    pods = []
    for index in range(8):
        app = rng.choice(LABELS)
        named = {("web", "TCP"): rng.choice(PORTS)} if rng.random() < 0.5 else {}
        address = f"10.0.{index % 2}.{index + 1}"
        number = int(ipaddress.ip_address(address))
        pods.append(
            Pod(rng.choice("xy"), f"p{index}", {"app": app}, f"n{index % 2 + 1}", (address,),
                (number,), named)
        )  # fmt: skip
    return pods


def random_peer(rng: random.Random) -> dict[str, Any]:
    kind = rng.randrange(4)
    if kind == 0:
        return {"podSelector": {"matchLabels": {"app": rng.choice(LABELS)}}}
    if kind == 1:
        return from_namespace(rng.choice("xy"))
    if kind == 2:
        return {**from_namespace(rng.choice("xy")), "podSelector": {"matchLabels": {"app": "a"}}}
    return {"ipBlock": {"cidr": "10.0.0.0/23", "except": [f"10.0.{rng.randrange(2)}.0/29"]}}


def random_rule(rng: random.Random, direction: str) -> dict[str, Any]:
    rule: dict[str, Any] = {}
    if rng.random() < 0.7:
        rule["from" if direction == "ingress" else "to"] = [random_peer(rng)]
    if rng.random() < 0.7:
        port: dict[str, Any] = rng.choice(
            [{"port": rng.choice(PORTS)}, {"port": "web"}, {"port": 80, "endPort": 8080},
             {"protocol": "UDP"}]
        )  # fmt: skip
        rule["ports"] = [port]
    return rule


def random_policy(rng: random.Random, index: int) -> NetworkPolicy:
    types = rng.choice([["Ingress"], ["Egress"], ["Ingress", "Egress"]])
    spec: dict[str, Any] = {
        "podSelector": {"matchLabels": {"app": rng.choice(LABELS)}} if rng.random() < 0.7 else {},
        "policyTypes": types,
    }
    for direction in ("ingress", "egress"):
        if direction.capitalize() in types:
            spec[direction] = [random_rule(rng, direction) for _ in range(rng.randrange(3))]
    name = f"p{index}"
    return parse_policy({"metadata": {"namespace": rng.choice("xy"), "name": name}, "spec": spec})


def random_cluster_policy(rng: random.Random, index: int) -> Any:
    tier = rng.choice(["Admin", "Baseline"])
    action = rng.choice(["Accept", "Deny"] + (["Pass"] if tier == "Admin" else []))
    peer = {"namespaces": from_namespace(rng.choice("xy"))["namespaceSelector"]}
    subject = {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "a"}}}}
    direction = rng.choice(["ingress", "egress"])
    rule = {"action": action, ("from" if direction == "ingress" else "to"): [peer]}
    spec = {"tier": tier, "priority": index, "subject": subject, direction: [rule]}
    return parse_cluster_policy({"metadata": {"name": f"c{index}"}, "spec": spec})


def random_objects(
    rng: random.Random,
) -> tuple[list[Pod], tuple[NetworkPolicy, ...], tuple[ClusterNetworkPolicy, ...]]:
    """Eight pods, one to three NetworkPolicies and up to two ClusterNetworkPolicies."""
    pods = random_pods(rng)
    policies = tuple(random_policy(rng, i) for i in range(rng.randrange(1, 4)))
    cluster_policies = tuple(random_cluster_policy(rng, i) for i in range(rng.randrange(3)))
    return pods, policies, cluster_policies
