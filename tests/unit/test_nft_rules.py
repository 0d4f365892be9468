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
    KernelTable,
    TableState,
    full_transactions,
    live_generation,
    partial_transaction,
)
from proxyd.port_plan import FamilyContext, PortPlan
from tests.support.example_service import CTX, CTX6, NAME, PORT, READY, planned


def objects(
    port: ServicePort, endpoints: tuple[Endpoint, ...], ctx: FamilyContext = CTX
) -> ServiceObjects:
    return render_service(planned(port, endpoints, ctx), PortContext.of(ctx))


def state(*ports: tuple[ServicePort, tuple[Endpoint, ...]]) -> TableState:
    """A table as a full sync wrote it."""
    table = TableState(render_base(CTX))
    chunk = {port.name: objects(port, endpoints) for port, endpoints in ports}
    list(full_transactions(4, table, [chunk], KernelTable()))
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
    (deleted,) = [
        line for line in text.splitlines() if " service-ips " in line and "delete" in line
    ]
    assert "203.0.113.7 . tcp . 80" in deleted, "one statement deletes the set's keys"
    assert "203.0.113.7 . tcp . 80 : goto spread-ips-tcp-1" in text
    assert table.owners["service-ips"][key] == second_name
    assert not table.rivals


def test_a_full_sync_fills_the_other_generation_then_switches_the_rules_over() -> None:
    spread = "spread-ips-tcp-2"
    affinity = ServiceNames(NAME).cluster
    unused = "spread-ips-tcp-3"
    kernel = KernelTable(
        chains={spread, unused, "services", "nat-prerouting", affinity, "service-OLD-ns/gone/tcp/"},
        sets={"service-ips", "endpoints-ips-tcp", "hairpin", "hairpin-1", "affinity-OLD"},
    )
    table = TableState(render_base(CTX), generation=1)
    sticky = dataclasses.replace(PORT, affinity_timeout=30)
    plain = ServicePort(ServicePortName("ns", "plain", "", "TCP"), ("10.96.0.11",), 80)
    chunk = {NAME: objects(sticky, READY), plain.name: objects(plain, READY)}
    first, filled, switch = list(full_transactions(4, table, [chunk], kernel))
    assert "add map ip knit service-ips-1 {" in first and "flush map" not in first
    assert "flush set ip knit hairpin-1" in first, "what a sync that did not end left goes"
    assert "add element ip knit service-ips-1 {" in filled and " service-ips " not in filled
    assert f"flush chain ip knit {affinity}" in filled, "a port's own chain, rewritten at once"
    assert f"chain ip knit {spread}" not in filled, "the spread chain the live maps use waits"
    assert switch.index("flush chain ip knit services") < switch.index(
        "delete map ip knit service-ips\n"
    )
    assert "add rule ip knit services ip daddr . meta l4proto . th dport vmap @service-ips-1" in (
        switch
    )
    assert f"add rule ip knit {spread} " in switch and "map @endpoints-ips-tcp-1" in switch
    assert switch.index("delete map ip knit service-ips\n") < switch.index(
        "delete chain ip knit service-OLD-ns/gone/tcp/"
    ), "the old maps go before the chains their elements name"
    assert (
        switch.index(f"flush chain ip knit {unused}")
        < switch.index("delete map ip knit endpoints-ips-tcp\n")
        < switch.index(f"delete chain ip knit {unused}")
    ), "a spread chain that lost its last user lets go of the old endpoint map first"
    assert "delete set ip knit hairpin\n" in switch and "delete set ip knit hairpin-1" not in switch
    assert "delete set ip knit affinity-OLD" in switch
    assert not table.kernel_chains, "partial syncs after it know every chain they wrote"


def test_the_live_generation_is_read_from_the_maps_held_and_only_then_from_the_rules() -> None:
    base = render_base(CTX)

    def unlisted() -> str:
        raise AssertionError("listed a chain")

    assert live_generation(base, set(), unlisted) is None
    assert live_generation(base, {"service-ips-1", "hairpin-1"}, unlisted) == 1
    both = {"service-ips", "service-ips-1"}
    listing = "chain services {\n ip daddr . meta l4proto . th dport vmap @service-ips-1\n}"
    assert live_generation(base, both, lambda: listing) == 1
    assert live_generation(base, both, lambda: None) is None


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


def test_chunks_of_ports_end_as_one_chunk_would() -> None:
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
    texts = list(full_transactions(4, chunked, chunks, KernelTable()))
    assert len(texts) == 5 and not any("delete" in text for text in texts), (
        "in name order, no chunk takes a key over from an earlier one; nothing to remove"
    )
    assert chunked.services == whole.services
    assert chunked.owners == whole.owners and chunked.rivals == whole.rivals
    assert chunked.members == whole.members and chunked.spread_users == whole.spread_users


def test_chunks_start_small_and_double_up_to_the_largest() -> None:
    names = [ServicePortName("ns", f"s{index}", "", "TCP") for index in range(2500)]
    sizes = [len(chunk) for chunk in nftables_proxier.chunks(names)]
    assert sizes == [100, 200, 400, 800, 1000]
    assert [name for chunk in nftables_proxier.chunks(names) for name in chunk] == names


def test_invalid_packets_are_dropped_unless_conntrack_is_liberal() -> None:
    assert "ct state invalid drop" in render_base(CTX).chains["filter-forward"]
    liberal = dataclasses.replace(CTX, drop_invalid=False)
    assert "ct state invalid drop" not in render_base(liberal).chains["filter-forward"]


def test_a_cluster_ip_stays_in_the_undeclared_port_set_while_a_port_holds_it() -> None:
    assert objects(PORT, ()).members["cluster-addresses"] == {"10.96.0.10"}
    other_port = ServicePort(ServicePortName("ns", "web", "https", "TCP"), ("10.96.0.10",), 443)
    table = state((PORT, READY), (other_port, READY))
    text = partial_transaction(4, table, {NAME: None})
    assert "cluster-addresses" not in text, "the https port still holds 10.96.0.10"
    text = partial_transaction(4, table, {other_port.name: None})
    assert "delete element ip knit cluster-addresses" in text and "10.96.0.10 }" in text
    base = render_base(CTX)
    assert base.chains["undeclared-ports-check"] == ("ip daddr @cluster-addresses reject",)
    assert base.hooks["filter-output-post-dnat"] == "type filter hook output priority -90"
    assert "ct state new jump undeclared-ports-check" in base.chains["filter-forward"]


def test_unallocated_addresses_of_the_service_ranges_are_dropped_after_the_port_check() -> None:
    assert render_base(CTX).chains["undeclared-ports-check"] == (
        "ip daddr @cluster-addresses reject",
    ), "no ServiceCIDR known: nothing dropped"
    ranges = dataclasses.replace(
        CTX, service_cidrs=("10.96.0.0/16", "10.96.4.0/24", "10.98.0.0/16")
    )
    assert render_base(ranges).chains["undeclared-ports-check"] == (
        "ip daddr @cluster-addresses reject",
        "ip daddr { 10.96.0.0/16, 10.98.0.0/16 } drop",
    ), "nested ranges merged: an anonymous interval set refuses overlaps"
    assert render_base(ranges) != render_base(CTX), "a new range makes the next sync full"
