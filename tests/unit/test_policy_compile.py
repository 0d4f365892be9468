"""From policies, pods and namespaces to a family's sets, chains and maps, and the nft
transactions between two such states."""

from __future__ import annotations

import dataclasses
import ipaddress
import random
from typing import Any

from proxyd.policy.cluster_model import ClusterNetworkPolicy, parse_cluster_policy
from proxyd.policy.compile import (
    ALLOW,
    DROP,
    NEXT,
    Cluster,
    FamilyCompiler,
    Match,
    compile_family,
    merged,
)
from proxyd.policy.model import MAX_EXCEPT, Namespace, NetworkPolicy, Pod, parse_policy
from proxyd.policy.render import Renderer


def value(ip: str) -> int:
    return int(ipaddress.ip_address(ip))


def pod(ns: str, name: str, ip: str, node: str = "n1", **ports: int) -> Pod:
    named = {(k, "TCP"): v for k, v in ports.items()}
    return Pod(ns, name, {"app": name}, node, (ip,), (value(ip),), named)


def policy(ns: str, spec: dict[str, Any]) -> NetworkPolicy:
    return parse_policy({"metadata": {"namespace": ns, "name": "p"}, "spec": spec})


PODS = [
    pod("x", "web", "10.0.0.1", web=8080),
    pod("x", "other", "10.0.0.2"),
    pod("y", "client", "10.0.1.1", node="n2", web=9090),
]
NAMESPACES = {n: Namespace(n, {"kubernetes.io/metadata.name": n}) for n in ("x", "y")}


def cluster(*policies: NetworkPolicy, pods: list[Pod] = PODS) -> Cluster:
    return Cluster.of("n1", {(p.namespace, p.name): p for p in pods}, NAMESPACES, policies)


def test_only_local_selected_pods_get_chains() -> None:
    out = compile_family(cluster(policy("x", {"podSelector": {}})), 4)
    assert set(out.ingress) == {"10.0.0.1", "10.0.0.2"}
    assert not out.egress
    assert all(chain.matches == () for chain in out.chains.values())
    assert out.local == {"10.0.0.1", "10.0.0.2"}


def test_ingress_named_port_resolves_on_the_selected_pod() -> None:
    spec = {"podSelector": {}, "ingress": [{"ports": [{"port": "web"}]}]}
    out = compile_family(cluster(policy("x", spec)), 4)
    assert out.chains[out.ingress["10.0.0.1"]].matches == (Match(None, "tcp", 8080, 8080),)
    # a pod without the name matches nothing
    assert out.chains[out.ingress["10.0.0.2"]].matches == ()


def test_egress_named_port_resolves_on_each_peer() -> None:
    spec = {
        "podSelector": {"matchLabels": {"app": "web"}},
        "policyTypes": ["Egress"],
        "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": "web"}]}],
    }
    out = compile_family(cluster(policy("x", spec)), 4)
    (allow,) = out.chains[out.egress["10.0.0.1"]].matches
    assert allow.peer_ports is not None
    assert out.peer_ports[allow.peer_ports] == {
        ("10.0.0.1", "tcp", 8080),
        ("10.0.1.1", "tcp", 9090),
    }


def test_ip_block_except_and_selected_pods_merge_into_intervals() -> None:
    spec = {
        "podSelector": {"matchLabels": {"app": "web"}},
        "ingress": [
            {
                "from": [
                    {"ipBlock": {"cidr": "192.168.0.0/16", "except": ["192.168.1.0/24"]}},
                    {"podSelector": {"matchLabels": {"app": "other"}}},
                ]
            }
        ],
    }
    out = compile_family(cluster(policy("x", spec)), 4)
    (allow,) = out.chains[out.ingress["10.0.0.1"]].matches
    assert allow.peers is not None
    assert out.peers[allow.peers] == {
        (value("10.0.0.2"), value("10.0.0.2")),
        (value("192.168.0.0"), value("192.168.0.255")),
        (value("192.168.2.0"), value("192.168.255.255")),
    }
    assert compile_family(cluster(policy("x", spec)), 6).ingress == {}


def test_only_peers_with_an_ip_block_of_the_family_make_an_interval_set() -> None:
    def declared(spec: dict[str, Any], family: int) -> str:
        text = Renderer(family).full(
            compile_family(cluster(policy("x", spec)), family), replacing=False
        )
        (line,) = [
            line for line in text.splitlines() if line.startswith("add set") and "peers-" in line
        ]
        return line

    def from_(*peers: dict[str, Any]) -> dict[str, Any]:
        return {"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [{"from": list(peers)}]}

    pods_only = from_({"podSelector": {"matchLabels": {"app": "other"}}})
    block = from_({"ipBlock": {"cidr": "192.168.0.0/16"}}, {"podSelector": {}})
    assert "flags interval" not in declared(pods_only, 4)
    assert "flags interval" in declared(block, 4)
    # the block is IPv4's: in IPv6 the same peers are pod addresses only
    pod6 = [
        dataclasses.replace(p, addresses=(f"fd00::{i}",), numbers=(value(f"fd00::{i}"),))
        for i, p in enumerate(PODS, 1)
    ]
    text = Renderer(6).full(
        compile_family(cluster(policy("x", block), pods=pod6), 6), replacing=False
    )
    assert "add set ip6 knit-policy peers-" in text
    assert "flags interval" not in text


def test_merged_joins_overlapping_and_adjacent_intervals() -> None:
    assert merged([(5, 9), (1, 3), (4, 4), (20, 30), (25, 26)]) == {(1, 9), (20, 30)}


def test_a_peer_namespace_selector_without_match_allows_nothing() -> None:
    spec = {
        "podSelector": {},
        "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": "none"}}}]}],
    }
    out = compile_family(cluster(policy("x", spec)), 4)
    (allow,) = out.chains[out.ingress["10.0.0.1"]].matches
    assert allow.peers is not None and out.peers[allow.peers] == set()


def test_a_label_change_changes_set_elements_only() -> None:
    spec = {
        "podSelector": {"matchLabels": {"app": "web"}},
        "ingress": [
            {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "client"}}}]}
        ],
    }
    before = compile_family(cluster(policy("x", spec)), 4)
    moved = [*PODS[:2], pod("y", "client", "10.0.1.7", node="n2")]
    after = compile_family(cluster(policy("x", spec), pods=moved), 4)
    text = Renderer(4).partial(before, after)
    lines = text.splitlines()
    assert all(" element " in line for line in lines), text
    assert lines[0].startswith("delete element") and lines[-1].startswith("add element")
    assert Renderer(4).partial(after, after) == ""


def test_a_full_transaction_deletes_the_table_only_when_one_is_in_the_kernel() -> None:
    spec = {"podSelector": {}, "ingress": [{"from": [{"podSelector": {}}]}]}
    wanted = compile_family(cluster(policy("x", spec)), 4)
    fresh = Renderer(4).full(wanted, replacing=False).splitlines()
    replacing = Renderer(4).full(wanted, replacing=True).splitlines()
    assert not [line for line in fresh if line.startswith("delete")]
    assert replacing[:2] == ["add table ip knit-policy", "delete table ip knit-policy"]
    assert replacing[2:] == fresh


def test_removing_the_last_policy_removes_its_chains_after_their_map_elements() -> None:
    spec = {"podSelector": {}, "ingress": [{"from": [{"podSelector": {}}]}]}
    before = compile_family(cluster(policy("x", spec)), 4)
    lines = Renderer(4).partial(before, compile_family(cluster(), 4)).splitlines()
    first_chain_delete = min(i for i, line in enumerate(lines) if line.startswith("delete chain"))
    map_deletes = [i for i, line in enumerate(lines) if "ingress-pods" in line]
    assert map_deletes and max(map_deletes) < first_chain_delete
    assert lines[-1].startswith("delete set")


def test_a_kept_compile_after_pod_changes_equals_a_fresh_one() -> None:
    """Pods come, go, change labels and addresses, policies come; the compiler that kept its
    peer sets and pod index and re-examined only the changed pods gives what a fresh compile
    gives."""
    rng = random.Random(7)
    specs = [
        {
            "podSelector": {"matchLabels": {"app": "a0"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a1"}}}]}],
        },
        {
            "podSelector": {},
            "policyTypes": ["Egress"],
            "egress": [
                {
                    "to": [
                        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "a2"}}}
                    ],
                    "ports": [{"port": "web"}],
                },
                {"to": [{"ipBlock": {"cidr": "10.0.0.0/24", "except": ["10.0.0.8/29"]}}]},
            ],
        },
    ]
    policies = tuple(policy(ns, spec) for ns in ("x", "y") for spec in specs)
    pods: dict[tuple[str, str], Pod] = {}
    for i in range(40):
        ns = "x" if i % 2 else "y"
        made = pod(ns, f"p{i}", f"10.0.0.{i + 1}", node="n1" if i % 3 else "n2", web=8000 + i)
        pods[(ns, made.name)] = dataclasses.replace(made, labels={"app": f"a{i % 3}"})
    kept = FamilyCompiler(4)
    kept.compile(Cluster.of("n1", pods, NAMESPACES, policies), None)
    for turn in range(30):
        if turn % 10 == 9:
            block = {"ipBlock": {"cidr": f"10.0.0.{turn * 4}/28"}}
            peer = {"podSelector": {"matchLabels": {"app": "a0"}}}
            spec = {"podSelector": {}, "ingress": [{"from": [block, peer]}]}
            policies = (
                *policies,
                parse_policy({"metadata": {"namespace": "x", "name": f"n{turn}"}, "spec": spec}),
            )
        changed = set(rng.sample(sorted(pods), 4))
        for key in changed:
            roll = rng.random()
            if roll < 0.2:
                del pods[key]
            elif roll < 0.6:
                pods[key] = dataclasses.replace(pods[key], labels={"app": f"a{rng.randrange(3)}"})
            else:
                last = rng.randrange(1, 250)
                pods[key] = dataclasses.replace(
                    pods[key], addresses=(f"10.0.0.{last}",), numbers=(value(f"10.0.0.{last}"),)
                )
        state = Cluster.of("n1", dict(pods), NAMESPACES, policies)
        assert kept.compile(state, changed) == compile_family(state, 4)


def cluster_policy(name: str, tier: str, priority: int, **rules: Any) -> ClusterNetworkPolicy:
    subject = {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "web"}}}}
    spec = {"tier": tier, "priority": priority, "subject": subject, **rules}
    return parse_cluster_policy({"metadata": {"name": name}, "spec": spec})


def from_namespace(action: str, namespace: str) -> dict[str, Any]:
    selector = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    return {"action": action, "from": [{"namespaces": selector}]}


def with_cluster_policies(*policies: ClusterNetworkPolicy, isolating: bool = False) -> Cluster:
    spec = {"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [{}]}
    return dataclasses.replace(
        cluster(*([policy("x", spec)] if isolating else [])), cluster_policies=policies
    )


def test_admin_rules_come_first_by_priority_then_networkpolicy_allows_the_rest() -> None:
    later = cluster_policy("b-later", "Admin", 20, ingress=[from_namespace("Accept", "y")])
    first = cluster_policy("a-first", "Admin", 10, ingress=[from_namespace("Deny", "y")])
    out = compile_family(with_cluster_policies(later, first, isolating=True), 4)
    chain = out.chains[out.ingress["10.0.0.1"]]
    assert [match.verdict for match in chain.matches] == [DROP, ALLOW, ALLOW]
    assert chain.otherwise == DROP and chain.next is None
    assert out.isolating[out.ingress["10.0.0.1"]] == ("a-first", "b-later", "p")
    assert "10.0.0.2" not in out.ingress  # no policy judges the other pod


def test_an_admin_pass_goes_to_a_next_chain_holding_the_networkpolicy_rules() -> None:
    passing = cluster_policy("pass", "Admin", 1, ingress=[from_namespace("Pass", "y")])
    deny = cluster_policy("deny", "Admin", 2, ingress=[from_namespace("Deny", "y")])
    out = compile_family(with_cluster_policies(passing, deny, isolating=True), 4)
    first = out.ingress["10.0.0.1"]
    chain = out.chains[first]
    assert [match.verdict for match in chain.matches] == [NEXT, DROP]
    assert chain.otherwise == NEXT and chain.next == f"{first}-next"
    rest = out.chains[f"{first}-next"]
    assert [match.verdict for match in rest.matches] == [ALLOW]
    assert (rest.otherwise, rest.counter) == (DROP, first)
    assert list(out.chains) == [f"{first}-next", first]  # made before what goes to it
    text = Renderer(4).full(out, replacing=False)
    assert text.index(f"add chain ip knit-policy {first}-next") < text.index(
        f"add chain ip knit-policy {first} "
    )
    gone = Renderer(4).partial(out, compile_family(cluster(), 4)).splitlines()
    assert gone.index(f"delete chain ip knit-policy {first}") < gone.index(
        f"delete chain ip knit-policy {first}-next"
    )


def test_baseline_judges_only_pods_no_networkpolicy_isolates() -> None:
    baseline = cluster_policy(
        "base", "Baseline", 5, ingress=[from_namespace("Pass", "x"), from_namespace("Deny", "y")]
    )
    out = compile_family(with_cluster_policies(baseline), 4)
    chain = out.chains[out.ingress["10.0.0.1"]]
    # a Baseline Pass leaves the decision to the default, which allows
    assert [match.verdict for match in chain.matches] == [ALLOW, DROP]
    assert chain.otherwise == ALLOW
    isolated = compile_family(with_cluster_policies(baseline, isolating=True), 4)
    chain = isolated.chains[isolated.ingress["10.0.0.1"]]
    assert [match.verdict for match in chain.matches] == [ALLOW]
    assert isolated.isolating[isolated.ingress["10.0.0.1"]] == ("p",)


def test_ip_block_except_sweep_keeps_what_carving_each_hole_keeps() -> None:
    chooser = random.Random(7)
    for _ in range(60):
        holes = [
            str(
                ipaddress.ip_network(
                    f"10.0.{chooser.randrange(16)}.{chooser.randrange(256)}/{p}", strict=False
                )
            )
            for p in chooser.choices(range(22, 33), k=chooser.randrange(12))
        ]
        spec = {
            "podSelector": {},
            "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/20", "except": holes}}]}],
        }
        out = compile_family(cluster(policy("x", spec)), 4)
        (allow,) = out.chains[out.ingress["10.0.0.1"]].matches
        assert allow.peers is not None
        carved = set(ipaddress.ip_network("10.0.0.0/20")) - {
            a for hole in holes for a in ipaddress.ip_network(hole)
        }
        pod_addresses = {value(p.addresses[0]) for p in PODS if p.namespace == "x"}
        kept = {
            address for first, last in out.peers[allow.peers] for address in range(first, last + 1)
        } - pod_addresses
        assert kept == {int(a) for a in carved} - pod_addresses, holes


def test_ip_block_over_the_except_cap_leaves_its_rule_out() -> None:
    holes = [f"10.{n >> 8}.{n & 255}.0/24" for n in range(MAX_EXCEPT + 1)]
    block = {"ipBlock": {"cidr": "10.0.0.0/8", "except": holes}}
    spec = {"podSelector": {}, "ingress": [{"from": [block]}]}
    parsed = policy("x", spec)
    assert parsed.ingress == () and "over knit's 20000" in parsed.problems[0]
    out = compile_family(cluster(parsed), 4)
    assert out.chains[out.ingress["10.0.0.1"]].matches == (), "isolated, nothing allowed"
