"""The nftables datapath's rendering and transactions (pure; the kernel side is exercised by
tests/integration/test_proxy_services.py in nftables mode)."""

from __future__ import annotations

import dataclasses

from proxyd.model import Endpoint, ServicePort, ServicePortName
from proxyd.nftables.render import ServiceNames, ServiceObjects, render_base, render_service
from proxyd.nftables.transaction import TableState, full_transaction, partial_transaction
from proxyd.plan import FamilyContext
from tests.unit.example_service import CTX, CTX6, NAME, PORT, READY, planned


def objects(
    port: ServicePort, endpoints: tuple[Endpoint, ...], ctx: FamilyContext = CTX
) -> ServiceObjects:
    return render_service(planned(port, endpoints, ctx), ctx)


def state(*ports: tuple[ServicePort, tuple[Endpoint, ...]]) -> TableState:
    """A table as a full sync wrote it."""
    table = TableState(render_base(CTX))
    for port, endpoints in ports:
        table.services[port.name] = objects(port, endpoints)
    full_transaction(4, table, set(), set())
    return table


def test_cluster_ip_dispatches_through_the_map_and_spreads_in_one_chain() -> None:
    names = ServiceNames(NAME)
    rendered = objects(PORT, READY)
    assert rendered.elements["service-ips"] == {("10.96.0.10 . tcp . 80", f"goto {names.cluster}")}
    assert rendered.chains[names.cluster] == (
        "ip daddr 10.96.0.10 tcp dport 80 ip saddr != 10.244.0.0/16 jump mark-for-masquerade",
        "numgen random mod 2 0 meta l4proto tcp dnat to 10.244.1.5:8080",
        "meta l4proto tcp dnat to 10.244.2.5:8080",
    )
    assert rendered.elements["hairpin"] == {
        ("10.244.1.5 . 10.244.1.5", ""),
        ("10.244.2.5 . 10.244.2.5", ""),
    }


def test_no_endpoints_rejects_and_a_local_policy_without_local_endpoints_drops() -> None:
    assert objects(PORT, ()).elements == {
        "no-endpoint-services": {("10.96.0.10 . tcp . 80", "goto reject-chain")}
    }
    local = dataclasses.replace(
        PORT, node_port=30080, external_ips=("203.0.113.5",), external_policy_local=True
    )
    rendered = objects(local, READY[1:])
    assert rendered.elements["no-endpoint-nodeports"] == {("tcp . 30080", "drop")}
    assert rendered.elements["no-endpoint-external"] == {("203.0.113.5 . tcp . 80", "drop")}
    external = rendered.chains[ServiceNames(NAME).external]
    assert "ip saddr 10.244.0.0/16 goto" in external[0], "pods still reach the service"


def test_affinity_remembers_each_endpoint_in_a_timed_set() -> None:
    sticky = dataclasses.replace(PORT, affinity_timeout=30)
    rendered = objects(sticky, READY)
    names = ServiceNames(NAME)
    assert len(rendered.sets) == 2
    assert all("timeout 30s" in declaration for declaration in rendered.sets.values())
    first = names.affinity(READY[0], 30)
    rules = rendered.chains[names.cluster]
    assert rules[1].startswith(f"ip saddr @{first} update @{first}")
    assert names.affinity(READY[0], 60) != first, "a new timeout makes a new set"


def test_load_balancer_source_ranges_guard_the_vip() -> None:
    lb = dataclasses.replace(
        PORT, load_balancer_ips=("203.0.113.9",), source_ranges=("198.18.0.0/24",)
    )
    rendered = objects(lb, READY)
    names = ServiceNames(NAME)
    assert rendered.elements["firewall-ips"] == {
        ("203.0.113.9 . tcp . 80", f"goto {names.firewall}")
    }
    assert rendered.chains[names.firewall] == ("ip saddr != { 198.18.0.0/24 } counter drop",)


def test_ipv6_uses_its_own_keywords_and_names_without_colons() -> None:
    rendered = objects(PORT, (Endpoint("fd10::5", 8080),), CTX6)
    chain = ServiceNames(NAME).cluster
    assert rendered.chains[chain][-1] == "meta l4proto tcp dnat to [fd10::5]:8080"
    assert all(":" not in name for name in rendered.chains)
    assert render_base(CTX6).maps["service-ips"].startswith("{ type ipv6_addr")


def test_a_changed_endpoint_rewrites_only_its_service() -> None:
    other = ServicePort(ServicePortName("ns", "other", "", "TCP"), ("10.96.0.11",), 80)
    old = state((PORT, READY), (other, READY))
    new = old.copy()
    new.services[NAME] = objects(PORT, (READY[0], Endpoint("10.244.3.5", 8080)))
    text = partial_transaction(4, old, new, [NAME])
    assert f"flush chain ip knit {ServiceNames(NAME).cluster}" in text
    assert "other" not in text
    assert "delete element ip knit hairpin { 10.244.2.5 . 10.244.2.5 }" not in text, (
        "the other service still uses that endpoint"
    )
    assert "add element ip knit hairpin { 10.244.3.5 . 10.244.3.5 }" in text
    assert "service-ips" not in text, "the dispatch element did not change"


def test_a_deleted_service_loses_its_elements_then_its_chains() -> None:
    old = state((PORT, READY))
    new = old.copy()
    del new.services[NAME]
    lines = partial_transaction(4, old, new, [NAME]).splitlines()
    chain = ServiceNames(NAME).cluster
    element = lines.index("delete element ip knit service-ips { 10.96.0.10 . tcp . 80 }")
    assert lines.index(f"flush chain ip knit {chain}") > element
    assert lines.index(f"delete chain ip knit {chain}") > lines.index(
        f"flush chain ip knit {chain}"
    )
    assert not new.owners and not new.claims


def test_a_shared_external_ip_passes_to_the_next_claimant() -> None:
    shared = ("203.0.113.7",)
    first = dataclasses.replace(PORT, external_ips=shared)
    second_name = ServicePortName("ns", "zz", "http", "TCP")
    second = ServicePort(second_name, ("10.96.0.12",), 80, external_ips=shared)
    old = state((first, READY), (second, READY))
    key = ("service-ips", "203.0.113.7 . tcp . 80")
    assert old.owners[key] == NAME
    new = old.copy()
    del new.services[NAME]
    text = partial_transaction(4, old, new, [NAME])
    assert "delete element ip knit service-ips { 203.0.113.7 . tcp . 80 }" in text
    takeover = f"203.0.113.7 . tcp . 80 : goto {ServiceNames(second_name).external}"
    assert takeover in text
    assert new.owners[key] == second_name


def test_full_sync_flushes_what_exists_and_removes_what_is_stale() -> None:
    table = state((PORT, READY))
    chain = ServiceNames(NAME).cluster
    text = full_transaction(4, table, {chain, "services", "service-OLD-ns/gone/tcp/"}, {"hairpin"})
    assert f"flush chain ip knit {chain}" in text
    assert f"add chain ip knit {chain}" not in text
    assert "delete chain ip knit service-OLD-ns/gone/tcp/" in text
    assert "delete set" not in text, "the table's own sets stay"
    assert "flush map ip knit service-ips" in text and "flush set ip knit hairpin" in text
