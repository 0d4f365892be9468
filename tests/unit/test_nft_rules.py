"""The nftables datapath's rendering and transactions (pure; the kernel side is exercised by
tests/integration/test_proxy_services.py in nftables mode)."""

from __future__ import annotations

import dataclasses

from proxyd.model import Endpoint, ServicePort, ServicePortName
from proxyd.nftables import proxier as nftables_proxier
from proxyd.nftables.render import (
    PortContext,
    Renderer,
    ServiceNames,
    ServiceObjects,
    render_base,
    render_service,
)
from proxyd.nftables.transaction import (
    TableState,
    fresh_transactions,
    full_transaction,
    partial_transaction,
)
from proxyd.plan import FamilyContext, PortPlan
from tests.unit.example_service import CTX, CTX6, NAME, PORT, READY, planned


def objects(
    port: ServicePort, endpoints: tuple[Endpoint, ...], ctx: FamilyContext = CTX
) -> ServiceObjects:
    return render_service(planned(port, endpoints, ctx), PortContext.of(ctx))


def state(*ports: tuple[ServicePort, tuple[Endpoint, ...]]) -> TableState:
    """A table as a full sync wrote it."""
    table = TableState(render_base(CTX))
    chunk = {port.name: objects(port, endpoints) for port, endpoints in ports}
    list(full_transaction(4, table, [chunk], set(), set()))
    return table


def test_a_cluster_ip_is_elements_only_and_spreads_through_a_shared_chain() -> None:
    rendered = objects(PORT, READY)
    assert rendered.chains == {}, "no chain of its own"
    assert rendered.elements["service-ips"] == {"10.96.0.10 . tcp . 80": "goto spread-ips-tcp-2"}
    assert rendered.members["cluster-ips"] == {"10.96.0.10 . tcp . 80"}
    assert rendered.elements["endpoints-ips-tcp"] == {
        "10.96.0.10 . 80 . 0": "10.244.1.5 . 8080",
        "10.96.0.10 . 80 . 1": "10.244.2.5 . 8080",
    }
    assert rendered.members["hairpin"] == {"10.244.1.5 . 10.244.1.5", "10.244.2.5 . 10.244.2.5"}
    (spread,) = rendered.spreads
    assert spread.rules(4) == (
        "meta l4proto tcp dnat to ip daddr . tcp dport . numgen random mod 2 "
        "map @endpoints-ips-tcp",
    )


def test_no_endpoints_rejects_and_a_local_policy_without_local_endpoints_drops() -> None:
    assert objects(PORT, ()).elements == {
        "no-endpoint-services": {"10.96.0.10 . tcp . 80": "goto reject-chain"}
    }
    local = dataclasses.replace(
        PORT, node_port=30080, external_ips=("203.0.113.5",), external_policy_local=True
    )
    rendered = objects(local, READY[1:])
    assert rendered.elements["no-endpoint-nodeports"] == {"tcp . 30080": "drop"}
    assert rendered.elements["no-endpoint-external"] == {"203.0.113.5 . tcp . 80": "drop"}
    assert rendered.elements["service-ips"]["203.0.113.5 . tcp . 80"] == "goto external-local-ips"
    assert rendered.elements["cluster-spread-ips"] == {
        "203.0.113.5 . tcp . 80": "goto spread-ips-tcp-1"
    }, "pods and the node still reach the service"
    assert "local-spread-ips" not in rendered.elements
    assert "masquerade-ips" not in rendered.members, "Local keeps the client's address"
    assert render_base(CTX).chains["external-local-ips"][0] == (
        "ip saddr 10.244.0.0/16 ip daddr . meta l4proto . th dport vmap @cluster-spread-ips"
    )


def test_affinity_remembers_each_endpoint_in_a_timed_set() -> None:
    sticky = dataclasses.replace(PORT, affinity_timeout=30)
    rendered = objects(sticky, READY)
    names = ServiceNames(NAME)
    assert len(rendered.sets) == 2
    assert all("timeout 30s" in declaration for declaration in rendered.sets.values())
    first = names.affinity(READY[0], 30)
    assert rendered.elements["service-ips"] == {"10.96.0.10 . tcp . 80": f"goto {names.cluster}"}
    assert rendered.chains[names.cluster][0].startswith(f"ip saddr @{first} update @{first}")
    assert not rendered.spreads
    assert names.affinity(READY[0], 60) != first, "a new timeout makes a new set"


def test_load_balancer_source_ranges_guard_the_vip() -> None:
    lb = dataclasses.replace(
        PORT, load_balancer_ips=("203.0.113.9",), source_ranges=("198.18.0.0/24",)
    )
    rendered = objects(lb, READY)
    names = ServiceNames(NAME)
    assert rendered.elements["firewall-ips"] == {"203.0.113.9 . tcp . 80": f"goto {names.firewall}"}
    assert rendered.chains[names.firewall] == ("ip saddr != { 198.18.0.0/24 } counter drop",)


def test_ipv6_uses_its_own_keywords_and_names_without_colons() -> None:
    sticky = dataclasses.replace(PORT, affinity_timeout=30)
    endpoints = (Endpoint("fd10::5", 8080),)
    rendered = objects(PORT, endpoints, CTX6)
    assert rendered.elements["endpoints-ips-tcp"] == {"fd00::10 . 80 . 0": "fd10::5 . 8080"}
    names = ServiceNames(NAME)
    affinity = names.affinity(endpoints[0], 30)
    assert affinity.endswith("__fd10..5/8080")
    assert objects(sticky, endpoints, CTX6).chains[names.cluster][-1] == (
        f"update @{affinity} {{ ip6 saddr }} meta l4proto tcp dnat to [fd10::5]:8080"
    )
    assert render_base(CTX6).maps["service-ips"].startswith("{ type ipv6_addr")


def test_a_changed_endpoint_changes_only_its_elements() -> None:
    other = ServicePort(ServicePortName("ns", "other", "", "TCP"), ("10.96.0.11",), 80)
    table = state((PORT, READY), (other, READY))
    moved = (READY[0], Endpoint("10.244.3.5", 8080))
    lines = partial_transaction(4, table, {NAME: objects(PORT, moved)}).splitlines()
    assert lines == [
        "delete element ip knit endpoints-ips-tcp { 10.96.0.10 . 80 . 1 }",
        "add element ip knit endpoints-ips-tcp { 10.96.0.10 . 80 . 1 : 10.244.3.5 . 8080 }",
        "add element ip knit hairpin { 10.244.3.5 . 10.244.3.5 }",
    ], "the other service still uses 10.244.2.5; the dispatch element stays"


def test_spread_chains_come_with_their_first_user_and_go_with_their_last() -> None:
    other = ServicePort(ServicePortName("ns", "other", "", "TCP"), ("10.96.0.11",), 80)
    table = state((PORT, READY), (other, READY))
    text = partial_transaction(4, table, {NAME: objects(PORT, READY[:1])})
    assert "add chain ip knit spread-ips-tcp-1" in text
    assert "spread-ips-tcp-2" not in text.replace("goto spread-ips-tcp-2", ""), "other uses it"
    lines = partial_transaction(4, table, {other.name: None}).splitlines()
    element = lines.index("delete element ip knit service-ips { 10.96.0.11 . tcp . 80 }")
    assert lines.index("delete chain ip knit spread-ips-tcp-2") > element


def test_a_deleted_service_loses_its_elements_then_its_chains() -> None:
    sticky = dataclasses.replace(PORT, affinity_timeout=30)
    table = state((sticky, READY))
    lines = partial_transaction(4, table, {NAME: None}).splitlines()
    chain = ServiceNames(NAME).cluster
    element = lines.index("delete element ip knit service-ips { 10.96.0.10 . tcp . 80 }")
    assert lines.index(f"flush chain ip knit {chain}") > element
    assert lines.index(f"delete chain ip knit {chain}") > lines.index(
        f"flush chain ip knit {chain}"
    )
    assert not table.owners and not table.rivals and not table.members and not table.services


def test_a_shared_external_ip_passes_to_the_next_claimant() -> None:
    shared = ("203.0.113.7",)
    first = dataclasses.replace(PORT, external_ips=shared)
    second_name = ServicePortName("ns", "zz", "http", "TCP")
    second = ServicePort(second_name, ("10.96.0.12",), 80, external_ips=shared)
    table = state((first, READY), (second, READY[:1]))
    key = "203.0.113.7 . tcp . 80"
    assert table.owners["service-ips"][key] == NAME
    text = partial_transaction(4, table, {NAME: None})
    assert "delete element ip knit service-ips { 203.0.113.7 . tcp . 80 }" in text
    assert "203.0.113.7 . tcp . 80 : goto spread-ips-tcp-1" in text
    assert table.owners["service-ips"][key] == second_name
    assert not table.rivals


def test_full_sync_flushes_what_exists_and_removes_what_is_stale() -> None:
    spread = "spread-ips-tcp-2"
    existing = {spread, "services", "service-OLD-ns/gone/tcp/"}
    chunk = {NAME: objects(PORT, READY)}
    pieces = list(full_transaction(4, TableState(render_base(CTX)), [chunk], existing, {"hairpin"}))
    text = "".join(pieces)
    assert len(pieces) == 3, "the fixed part, the one chunk, the stale objects' removal"
    assert pieces[1] == partial_transaction(4, TableState(render_base(CTX)), chunk)
    flushed = text.index(f"flush chain ip knit {spread}")
    assert flushed < text.index(f"add rule ip knit {spread}"), "emptied, then filled"
    assert text.count(f"flush chain ip knit {spread}") == 1
    assert "flush chain ip knit services" in text and "add chain ip knit services" not in text
    assert "delete chain ip knit service-OLD-ns/gone/tcp/" in pieces[2]
    assert "delete set" not in text, "the table's own sets stay"
    assert "flush map ip knit service-ips" in text and "flush set ip knit hairpin" in text
    assert "flush map ip knit endpoints-ips-tcp" in text


def render_full(
    renderer: Renderer, plans: dict[ServicePortName, PortPlan], ctx: PortContext
) -> dict[ServicePortName, ServiceObjects]:
    renderer.begin_full(plans, ctx)
    return renderer.render(plans, plans)


def test_a_full_sync_renders_again_only_the_ports_whose_plans_changed() -> None:
    other = ServicePort(ServicePortName("ns", "other", "", "TCP"), ("10.96.0.11",), 80)
    renderer = Renderer()
    port_ctx = PortContext.of(CTX)
    first = render_full(
        renderer, {NAME: planned(PORT, READY), other.name: planned(other, READY)}, port_ctx
    )
    rezoned = dataclasses.replace(CTX, node=dataclasses.replace(CTX.node, zone="zone-b"))
    again = render_full(
        renderer,
        {NAME: planned(PORT, READY, rezoned), other.name: planned(other, READY[:1], rezoned)},
        PortContext.of(rezoned),
    )
    assert again[NAME] is first[NAME], "an equal plan keeps its objects"
    assert again[other.name] == objects(other, READY[:1])
    renderer.begin_full({other.name: planned(other, READY[:1])}, port_ctx)
    assert renderer.render({NAME: planned(PORT, READY)}, [NAME])[NAME] is not first[NAME], (
        "a port left out of a full sync is forgotten"
    )
    assert renderer.render_changed({}, [NAME]) == {NAME: None}
    masquerading = PortContext.of(dataclasses.replace(CTX, masquerade_all=True))
    assert render_full(renderer, {NAME: planned(PORT, READY)}, masquerading)[
        NAME
    ] == render_service(planned(PORT, READY), masquerading), "another context renders afresh"


def test_chunks_of_ports_end_as_one_chunk_would_in_a_transaction_each_or_in_one() -> None:
    shared = ("203.0.113.7",)
    ports = [
        dataclasses.replace(PORT, external_ips=shared, affinity_timeout=30),
        ServicePort(ServicePortName("ns", "a", "", "TCP"), ("10.96.0.11",), 80),
        ServicePort(
            ServicePortName("ns", "zz", "", "TCP"), ("10.96.0.12",), 80, external_ips=shared
        ),
    ]
    whole = state(*((port, READY) for port in ports))
    chunked = TableState(render_base(CTX))
    chunks = [{port.name: objects(port, READY)} for port in sorted(ports, key=lambda p: p.name)]
    texts = list(fresh_transactions(4, chunked, chunks, replace=True))
    fixed_part = "".join(full_transaction(4, TableState(render_base(CTX)), (), set(), set()))
    assert texts[0] == f"add table ip knit\ndelete table ip knit\n{fixed_part}", (
        "whatever sets a table without chains holds go"
    )
    absent = fresh_transactions(4, TableState(render_base(CTX)), [], replace=False)
    assert list(absent) == [fixed_part], "a table that does not exist is not deleted"
    assert len(texts) == 4 and not any("delete" in text for text in texts[1:]), (
        "in name order, no chunk takes a key over from an earlier one"
    )
    streamed = TableState(render_base(CTX))
    pieces = list(full_transaction(4, streamed, chunks, set(), set()))
    assert pieces[1:-1] == texts[1:], "one transaction: the same chunks between its ends"
    for table in (chunked, streamed):
        assert table.services == whole.services
        assert table.owners == whole.owners and table.rivals == whole.rivals
        assert table.members == whole.members and table.spread_users == whole.spread_users


def test_chunks_of_a_fresh_table_start_small_and_double_up_to_the_largest() -> None:
    names = [ServicePortName("ns", f"s{index}", "", "TCP") for index in range(2500)]
    sizes = [len(chunk) for chunk in nftables_proxier.chunks(names)]
    assert sizes == [100, 200, 400, 800, 1000]
    assert [name for chunk in nftables_proxier.chunks(names) for name in chunk] == names
