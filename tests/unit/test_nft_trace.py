"""Rule behaviour without root: the proxy's and the policy's tables, rendered by the real
renderers and applied to a fake ruleset, traced packet by packet (tests/support/nft_fake.py,
nft_trace.py). The namespace tests (tests/integration/test_proxy_services.py,
test_network_policy.py) prove the kernel agrees."""

from __future__ import annotations

import dataclasses
import ipaddress
from typing import Any

import pytest

from proxyd.model import Endpoint, ServicePort, ServicePortName
from proxyd.nftables.render import PortContext, ServiceNames, render_base, render_service
from proxyd.nftables.transaction import (
    KernelTable,
    TableState,
    full_transactions,
    partial_transaction,
)
from proxyd.policy.cluster_model import ClusterNetworkPolicy, parse_cluster_policy
from proxyd.policy.compile import ALLOW, DROP, Cluster, FamilyPolicy, compile_family
from proxyd.policy.flowlog import Logging
from proxyd.policy.model import Namespace, NetworkPolicy, Pod, parse_policy
from proxyd.policy.quarantine import quarantined
from proxyd.policy.render import CUT_MARK, Renderer
from proxyd.port_plan import FamilyContext
from tests.support.example_service import CTX, CTX6, NAME, PORT, READY, planned
from tests.support.nft_fake import NftError, Ruleset, applied
from tests.support.nft_trace import FORWARDED, FROM_NODE, TO_NODE, Packet, Trace, trace

NODE_ADDRESS = "192.0.2.10"
POD = "10.244.3.3"
"""A pod on another node, not an endpoint."""
OUTSIDE = "172.16.0.1"
CLUSTER_IP = "10.96.0.10"
ENDPOINTS = {(e.ip, e.port) for e in READY}
LOCAL_ENDPOINT = (READY[0].ip, READY[0].port)

# ------------------------------------------------------------------ the proxy's table


def port(name: str, cluster_ip: str, **fields: Any) -> ServicePort:
    return ServicePort(ServicePortName("ns", name, "http", "TCP"), (cluster_ip,), 80, **fields)


def rendered(
    ctx: FamilyContext, *ports: tuple[ServicePort, tuple[Endpoint, ...]]
) -> tuple[Ruleset, TableState]:
    """The table a full sync of `ports` writes, and its state for a partial sync after."""
    state = TableState(render_base(ctx))
    chunk = {
        p.name: render_service(planned(p, endpoints, ctx), PortContext.of(ctx))
        for p, endpoints in ports
    }
    return applied(full_transactions(ctx.family, state, [chunk], KernelTable())), state


def proxy(*ports: tuple[ServicePort, tuple[Endpoint, ...]]) -> Ruleset:
    return rendered(dataclasses.replace(CTX, service_cidrs=("10.96.0.0/16",)), *ports)[0]


def sent(
    ruleset: Ruleset, saddr: str, daddr: str, dport: int, hooks: tuple[str, ...] = FORWARDED
) -> Trace:
    local = (NODE_ADDRESS, "fd00:2::10")
    return trace(ruleset, Packet(saddr, daddr, dport, local=local), hooks)


def test_a_cluster_ip_goes_to_one_of_its_ready_endpoints() -> None:
    traced = sent(proxy((PORT, READY)), POD, CLUSTER_IP, 80)
    assert traced.verdict == "accept", traced
    assert traced.targets == ENDPOINTS
    assert traced.masqueraded == {False}, "a pod keeps its address"


def test_a_service_without_endpoints_rejects() -> None:
    traced = sent(proxy((PORT, ())), POD, CLUSTER_IP, 80)
    assert traced.verdict == "reject", traced
    assert traced.targets == set()


def test_a_port_no_service_declares_rejects_and_an_unallocated_cluster_ip_drops() -> None:
    ruleset = proxy((PORT, READY))
    assert sent(ruleset, POD, CLUSTER_IP, 81).verdict == "reject"
    assert sent(ruleset, POD, CLUSTER_IP, 81, FROM_NODE).verdict == "reject"
    assert sent(ruleset, POD, "10.96.7.7", 80).verdict == "drop"


def test_traffic_from_outside_the_cluster_cidr_to_a_cluster_ip_is_masqueraded() -> None:
    traced = sent(proxy((PORT, READY)), OUTSIDE, CLUSTER_IP, 80)
    assert traced.targets == ENDPOINTS
    assert traced.masqueraded == {True}, traced


def test_an_endpoint_reaching_itself_through_its_service_is_masqueraded() -> None:
    (itself, other) = READY
    traced = sent(proxy((PORT, READY)), itself.ip, CLUSTER_IP, 80)
    assert traced.to((itself.ip, itself.port)).masqueraded, traced
    assert not traced.to((other.ip, other.port)).masqueraded, traced


def test_a_nodeport_answers_on_the_node_address_and_on_localhost() -> None:
    ruleset = proxy((port("np", "10.96.0.12", node_port=30080), READY))
    from_outside = sent(ruleset, OUTSIDE, NODE_ADDRESS, 30080)
    assert from_outside.targets == ENDPOINTS
    assert from_outside.masqueraded == {True}, from_outside
    from_the_node = sent(ruleset, "127.0.0.1", "127.0.0.1", 30080, FROM_NODE)
    assert from_the_node.targets == ENDPOINTS, from_the_node
    assert from_the_node.masqueraded == {True}, "a reply to 127.0.0.1 could not come back"
    undeclared = sent(ruleset, OUTSIDE, NODE_ADDRESS, 30081, TO_NODE)
    assert (undeclared.verdict, undeclared.targets) == ("accept", frozenset()), (
        "the node's own port"
    )


def test_a_local_policy_sends_external_traffic_to_local_endpoints_only() -> None:
    local = port("local", "10.96.0.14", node_port=30082, external_policy_local=True)
    ruleset = proxy((local, READY))
    external = sent(ruleset, OUTSIDE, NODE_ADDRESS, 30082)
    assert external.targets == {LOCAL_ENDPOINT}, external
    assert external.masqueraded == {False}, "the client's address is kept"
    assert sent(ruleset, POD, NODE_ADDRESS, 30082).targets == ENDPOINTS, "pods use all"


def test_a_local_policy_without_a_local_endpoint_drops_external_traffic_only() -> None:
    remote_only = READY[1:]
    local = port(
        "local",
        "10.96.0.14",
        node_port=30082,
        external_ips=("203.0.113.5",),
        external_policy_local=True,
    )
    ruleset = proxy((local, remote_only))
    assert sent(ruleset, OUTSIDE, NODE_ADDRESS, 30082, TO_NODE).verdict == "drop"
    assert sent(ruleset, OUTSIDE, "203.0.113.5", 80).verdict == "drop"
    from_pod = sent(ruleset, POD, "203.0.113.5", 80)
    assert from_pod.targets == {(remote_only[0].ip, remote_only[0].port)}, from_pod


def test_load_balancer_source_ranges_pass_an_allowed_source_and_drop_others() -> None:
    lb = port(
        "lb", "10.96.0.13", load_balancer_ips=("198.51.100.7",), source_ranges=("192.0.2.0/24",)
    )
    ruleset = proxy((lb, READY))
    allowed = sent(ruleset, "192.0.2.99", "198.51.100.7", 80)
    assert allowed.targets == ENDPOINTS, allowed
    assert sent(ruleset, OUTSIDE, "198.51.100.7", 80).verdict == "drop"
    assert sent(ruleset, OUTSIDE, "10.96.0.13", 80).targets == ENDPOINTS, "not the cluster IP"


def test_session_affinity_keeps_a_remembered_source_on_its_endpoint() -> None:
    sticky = port("sticky", "10.96.0.15", affinity_timeout=10800)
    ruleset = proxy((sticky, READY))
    first = sent(ruleset, POD, "10.96.0.15", 80)
    assert first.targets == ENDPOINTS
    remembered = ServiceNames(sticky.name).affinity(READY[1], 10800)
    assert first.to((READY[1].ip, READY[1].port)).updates == (f"{remembered} <- {POD}",)
    ruleset.apply(f"add element ip knit {remembered} {{ {POD} }}\n")
    again = sent(ruleset, POD, "10.96.0.15", 80)
    assert again.targets == {(READY[1].ip, READY[1].port)}, again
    assert sent(ruleset, "10.244.9.9", "10.96.0.15", 80).targets == ENDPOINTS


def test_ipv6_a_cluster_ip_spreads_and_an_endpoint_reaching_itself_is_masqueraded() -> None:
    endpoints = (Endpoint("fd10:0:1::5", 8080), Endpoint("fd10:0:2::5", 8080))
    ruleset, _ = rendered(CTX6, (PORT, endpoints))
    traced = sent(ruleset, "fd10:0:1::5", "fd00::10", 80)
    assert traced.targets == {(e.ip, e.port) for e in endpoints}, traced
    assert traced.to(("fd10:0:1::5", 8080)).masqueraded
    assert sent(ruleset, "fd10:0:3::5", "fd00::10", 81).verdict == "reject"


def test_a_partial_sync_takes_effect_and_a_removed_service_goes_nowhere() -> None:
    ctx = dataclasses.replace(CTX, service_cidrs=("10.96.0.0/16",))
    gone = port("gone", "10.96.0.20")
    ruleset, state = rendered(ctx, (PORT, READY), (gone, READY))
    one_left = render_service(planned(PORT, READY[1:], ctx), PortContext.of(ctx))
    ruleset.apply(partial_transaction(4, state, {NAME: one_left, gone.name: None}))
    assert sent(ruleset, POD, CLUSTER_IP, 80).targets == {(READY[1].ip, READY[1].port)}
    assert sent(ruleset, POD, "10.96.0.20", 80).verdict == "drop", "an unallocated address"
    assert sent(ruleset, OUTSIDE, CLUSTER_IP, 80).masqueraded == {True}


def test_an_established_service_connection_is_left_to_conntrack() -> None:
    ruleset = proxy((PORT, ()))
    packet = Packet(POD, CLUSTER_IP, 80, state="established", dnat=True)
    assert trace(ruleset, packet, FORWARDED).verdict == "accept"


# ------------------------------------------------------------------ the policy's table


def pod(ns: str, name: str, ip: str, node: str = "n1", **ports: int) -> Pod:
    named = {(port_name, "TCP"): number for port_name, number in ports.items()}
    return Pod(ns, name, {"app": name}, node, (ip,), (int(ipaddress.ip_address(ip)),), named)


WEB, OTHER, CLIENT = "10.0.0.1", "10.0.0.2", "10.0.1.1"
PODS = (
    pod("x", "web", WEB, web=8080),
    pod("x", "other", OTHER),
    pod("y", "client", CLIENT, node="n2", web=9090),
)
NAMESPACES = {n: Namespace(n, {"kubernetes.io/metadata.name": n}) for n in ("x", "y")}
WEB_ONLY = {"matchLabels": {"app": "web"}}


def policy(spec: dict[str, Any]) -> NetworkPolicy:
    return parse_policy({"metadata": {"namespace": "x", "name": "p"}, "spec": spec})


def cluster_policy(tier: str, action: str, namespace: str) -> ClusterNetworkPolicy:
    peers = [{"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": namespace}}}]
    spec = {
        "tier": tier,
        "priority": 1,
        "subject": {"pods": {"namespaceSelector": {}, "podSelector": WEB_ONLY}},
        "ingress": [{"action": action, "from": peers}],
    }
    return parse_cluster_policy({"metadata": {"name": f"{tier}-{action}"}, "spec": spec})


def compiled(
    *policies: NetworkPolicy,
    admin: tuple[ClusterNetworkPolicy, ...] = (),
    pods: tuple[Pod, ...] = PODS,
) -> FamilyPolicy:
    cluster = Cluster.of("n1", {(p.namespace, p.name): p for p in pods}, NAMESPACES, policies)
    return compile_family(dataclasses.replace(cluster, cluster_policies=admin), 4)


def guarded(compiled_policy: FamilyPolicy, logging: Logging | None = None) -> Ruleset:
    return applied([Renderer(4, logging).full(compiled_policy, replacing=False)])


def verdict(ruleset: Ruleset, saddr: str, daddr: str, dport: int, **packet: Any) -> str:
    return trace(ruleset, Packet(saddr, daddr, dport, **packet), FORWARDED).verdict


INGRESS_FROM_OTHER_ON_8080 = policy(
    {
        "podSelector": WEB_ONLY,
        "ingress": [
            {
                "from": [{"podSelector": {"matchLabels": {"app": "other"}}}],
                "ports": [{"port": 8080}],
            }
        ],
    }
)


def test_a_pod_no_policy_isolates_is_reached_from_anywhere() -> None:
    ruleset = guarded(compiled(INGRESS_FROM_OTHER_ON_8080))
    assert verdict(ruleset, CLIENT, OTHER, 22) == "accept"


def test_an_ingress_isolated_pod_is_reached_only_from_allowed_peers_and_ports() -> None:
    ruleset = guarded(compiled(INGRESS_FROM_OTHER_ON_8080), Logging(5, frozenset({ALLOW, DROP})))
    assert verdict(ruleset, OTHER, WEB, 8080) == "accept"
    assert verdict(ruleset, OTHER, WEB, 8081) == "drop"
    assert verdict(ruleset, CLIENT, WEB, 8080) == "drop"
    assert verdict(ruleset, OTHER, WEB, 8080, protocol="udp") == "drop"


def test_egress_to_a_named_port_resolves_the_name_on_each_peer() -> None:
    spec = {
        "podSelector": WEB_ONLY,
        "policyTypes": ["Egress"],
        "egress": [{"to": [{"namespaceSelector": {}}], "ports": [{"port": "web"}]}],
    }
    ruleset = guarded(compiled(policy(spec)))
    assert verdict(ruleset, WEB, CLIENT, 9090) == "accept"
    assert verdict(ruleset, WEB, CLIENT, 8080) == "drop"
    assert verdict(ruleset, WEB, OTHER, 9090) == "drop", "other has no port named web"
    assert verdict(ruleset, OTHER, CLIENT, 22) == "accept", "other's egress is not judged"


def test_an_established_connection_passes_whatever_the_policy_unless_it_was_cut() -> None:
    ruleset = guarded(compiled(policy({"podSelector": {}})))
    assert verdict(ruleset, CLIENT, WEB, 8080) == "drop"
    assert verdict(ruleset, CLIENT, WEB, 8080, state="established") == "accept"
    cut = {"state": "established", "ct_mark": CUT_MARK | 1}
    assert verdict(ruleset, CLIENT, WEB, 8080, **cut) == "drop"
    assert verdict(ruleset, WEB, CLIENT, 40000, **cut) == "drop", "both ways"


def test_a_pods_traffic_to_itself_passes_its_isolation() -> None:
    ruleset = guarded(compiled(policy({"podSelector": {}, "policyTypes": ["Ingress", "Egress"]})))
    assert verdict(ruleset, WEB, WEB, 8080) == "accept"
    assert verdict(ruleset, WEB, OTHER, 8080) == "drop"


def test_an_admin_deny_beats_a_networkpolicy_allow() -> None:
    allow_all = policy({"podSelector": WEB_ONLY, "ingress": [{}]})
    ruleset = guarded(compiled(allow_all, admin=(cluster_policy("Admin", "Deny", "y"),)))
    assert verdict(ruleset, CLIENT, WEB, 8080) == "drop"
    assert verdict(ruleset, OTHER, WEB, 8080) == "accept"


def test_an_admin_pass_leaves_the_decision_to_the_networkpolicies() -> None:
    admin = (cluster_policy("Admin", "Pass", "y"),)
    assert verdict(guarded(compiled(admin=admin)), CLIENT, WEB, 8080) == "accept"
    only_other = guarded(compiled(INGRESS_FROM_OTHER_ON_8080, admin=admin))
    assert verdict(only_other, CLIENT, WEB, 8080) == "drop"
    assert verdict(only_other, OTHER, WEB, 8080) == "accept"


def test_baseline_judges_only_pods_no_networkpolicy_isolates() -> None:
    baseline = (cluster_policy("Baseline", "Deny", "y"),)
    assert verdict(guarded(compiled(admin=baseline)), CLIENT, WEB, 8080) == "drop"
    allow_all = policy({"podSelector": WEB_ONLY, "ingress": [{}]})
    assert verdict(guarded(compiled(allow_all, admin=baseline)), CLIENT, WEB, 8080) == "accept"


def test_a_quarantined_pod_drops_everything_in_its_direction() -> None:
    allow_all = compiled(policy({"podSelector": WEB_ONLY, "ingress": [{}]}))
    ruleset = guarded(quarantined(allow_all, [allow_all.ingress[WEB]]))
    assert verdict(ruleset, OTHER, WEB, 8080) == "drop"
    assert verdict(ruleset, WEB, OTHER, 8080) == "accept", "its egress is not judged"


def test_a_partial_transaction_after_a_label_change_moves_the_peer_out() -> None:
    spec = {
        "podSelector": WEB_ONLY,
        "ingress": [
            {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "client"}}}]}
        ],
    }
    before = compiled(policy(spec))
    ruleset = guarded(before)
    assert verdict(ruleset, CLIENT, WEB, 8080) == "accept"
    relabelled = (*PODS[:2], dataclasses.replace(PODS[2], labels={"app": "gone"}))
    ruleset.apply(Renderer(4).partial(before, compiled(policy(spec), pods=relabelled)))
    assert verdict(ruleset, CLIENT, WEB, 8080) == "drop"


def test_the_policy_judges_a_service_connection_by_the_endpoint_it_was_sent_to() -> None:
    service = port("web", "10.96.0.30")
    ruleset = proxy((service, (Endpoint(WEB, 8080),)))
    ruleset.apply(Renderer(4).full(compiled(INGRESS_FROM_OTHER_ON_8080), replacing=False))
    assert verdict(ruleset, OTHER, "10.96.0.30", 80) == "accept"
    traced = trace(ruleset, Packet(CLIENT, "10.96.0.30", 80), FORWARDED)
    assert traced.verdict == "drop", traced


# ------------------------------------------------------------------ the fake itself


def test_syntax_the_fake_does_not_know_raises() -> None:
    ruleset = applied(["add table ip t\nadd chain ip t c\n"])
    with pytest.raises(NftError, match="unknown expression 'queue'"):
        ruleset.apply("add rule ip t c queue num 1\n")
    with pytest.raises(NftError, match="ip6 saddr in an IPv4 table"):
        ruleset.apply("add rule ip t c ip6 saddr ::1 accept\n")
    with pytest.raises(NftError, match="not a verdict"):
        ruleset.apply(
            "add map ip t m { type ipv4_addr : verdict ; }\n"
            "add element ip t m { 10.0.0.1 : reject }\n"
        )


def test_a_failing_transaction_changes_nothing() -> None:
    ruleset = proxy((PORT, READY))
    before = sent(ruleset, POD, CLUSTER_IP, 80)
    with pytest.raises(NftError, match="another value"):
        ruleset.apply(
            "flush chain ip knit services\n"
            f"add element ip knit service-ips {{ {CLUSTER_IP} . tcp . 80 : drop }}\n"
        )
    with pytest.raises(NftError, match="still holds rules"):
        ruleset.apply(
            "delete element ip knit cluster-ips { 10.96.0.10 . tcp . 80 }\n"
            "delete chain ip knit reject-chain\n"
        )
    assert sent(ruleset, POD, CLUSTER_IP, 80) == before
