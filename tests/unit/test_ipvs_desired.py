"""The IPVS planner and its iptables rules (pure)."""

from __future__ import annotations

import dataclasses

from proxyd.iptables import chains as ch
from proxyd.iptables.chains import owned_by_knit
from proxyd.iptables.render import render_base
from proxyd.iptables.restore import RuleSet, TableSnapshot, full_scripts
from proxyd.ipvs import names
from proxyd.ipvs.desired import (
    Desired,
    Frontend,
    PortState,
    RealServer,
    dummy_addresses,
    nodeport_addresses,
    port_state,
)
from proxyd.ipvs.rules import render
from proxyd.model import Endpoint, ServicePort, ServicePortName
from proxyd.port_plan import FamilyContext
from tests.support.example_service import CTX, CTX6, NAME, PORT, planned

LOCAL = Endpoint("10.244.1.5", 8080, node_name="node-a")
REMOTE = Endpoint("10.244.2.5", 8080, node_name="node-b")
NODE_ADDRESSES = ("192.0.2.10", "198.51.100.10")


def state(
    port: ServicePort, endpoints: tuple[Endpoint, ...], ctx: FamilyContext = CTX
) -> PortState:
    return port_state(planned(port, endpoints, ctx), ctx, "rr", NODE_ADDRESSES)


def servers(s: PortState) -> dict[Frontend, set[RealServer]]:
    return {v.frontend: set(v.real_servers) for v in s.virtual_servers}


def members(s: PortState, key: str) -> set[str]:
    return {entry for k, entry in s.members if k == key}


def script(ctx: FamilyContext, snapshots: dict[str, TableSnapshot] | None = None) -> str:
    (written,) = full_scripts(RuleSet(render(ctx)), snapshots or {})
    return written.text()


def test_cluster_ip_gets_a_virtual_server_with_every_endpoint_and_is_bound() -> None:
    s = state(PORT, (LOCAL, REMOTE))
    (server,) = s.virtual_servers
    assert server.frontend == Frontend("10.96.0.10", "TCP", 80)
    assert server.scheduler == "rr" and server.timeout == 0
    assert server.real_servers == {RealServer("10.244.1.5", 8080), RealServer("10.244.2.5", 8080)}
    assert dummy_addresses(s.members) == {"10.96.0.10"}
    assert members(s, "CLUSTER-IP") == {"10.96.0.10,tcp:80"}
    assert members(s, "IPVS-IPS") == {"10.96.0.10"}
    assert members(s, "LOOP-BACK") == {
        "10.244.1.5,tcp:8080,10.244.1.5",
        "10.244.2.5,tcp:8080,10.244.2.5",
    }
    assert not members(s, "NO-ENDPOINTS") and not members(s, "NO-LOCAL-ENDPOINTS")


def test_affinity_is_persistence_with_the_timeout() -> None:
    s = state(dataclasses.replace(PORT, affinity_timeout=30), (LOCAL,))
    assert {v.timeout for v in s.virtual_servers} == {30}


def test_nodeport_serves_on_every_node_address_and_lands_in_the_protocol_set() -> None:
    udp = dataclasses.replace(PORT, name=dataclasses.replace(NAME, protocol="UDP"), node_port=30053)
    s = state(udp, (LOCAL, REMOTE))
    got = servers(s)
    assert Frontend("192.0.2.10", "UDP", 30053) in got
    assert Frontend("198.51.100.10", "UDP", 30053) in got
    assert got[Frontend("192.0.2.10", "UDP", 30053)] == got[Frontend("10.96.0.10", "UDP", 80)]
    assert members(s, "NODE-PORT-UDP") == {"30053"}
    assert not members(s, "NODE-PORT-TCP") and not members(s, "NODE-PORT-LOCAL-UDP")
    assert "192.0.2.10" not in dummy_addresses(s.members), "node addresses are never bound"


def test_external_policy_local_uses_local_endpoints_outside_and_all_inside() -> None:
    port = dataclasses.replace(
        PORT,
        node_port=30080,
        external_ips=("203.0.113.5",),
        load_balancer_ips=("203.0.113.7",),
        external_policy_local=True,
        health_check_node_port=31000,
    )
    s = state(port, (LOCAL, REMOTE))
    got = servers(s)
    both = {RealServer("10.244.1.5", 8080), RealServer("10.244.2.5", 8080)}
    assert got[Frontend("10.96.0.10", "TCP", 80)] == both
    for frontend in (
        Frontend("203.0.113.5", "TCP", 80),
        Frontend("203.0.113.7", "TCP", 80),
        Frontend("192.0.2.10", "TCP", 30080),
    ):
        assert got[frontend] == {RealServer("10.244.1.5", 8080)}
    assert members(s, "NODE-PORT-LOCAL-TCP") == {"30080"}
    assert members(s, "EXTERNAL-IP-LOCAL") == {"203.0.113.5,tcp:80"}
    assert not members(s, "EXTERNAL-IP")
    assert members(s, "LOAD-BALANCER") == members(s, "LOAD-BALANCER-LOCAL")
    assert members(s, "HEALTH-CHECK-NODE-PORT") == {"31000"}
    assert dummy_addresses(s.members) == {"10.96.0.10", "203.0.113.5", "203.0.113.7"}


def test_external_policy_local_without_local_endpoints_drops_external_frontends() -> None:
    port = dataclasses.replace(
        PORT, node_port=30080, external_ips=("203.0.113.5",), external_policy_local=True
    )
    s = state(port, (REMOTE,))
    assert members(s, "NO-LOCAL-ENDPOINTS") == {
        "203.0.113.5,tcp:80",
        "192.0.2.10,tcp:30080",
        "198.51.100.10,tcp:30080",
    }
    assert not members(s, "NO-ENDPOINTS")
    assert servers(s)[Frontend("203.0.113.5", "TCP", 80)] == set()
    assert servers(s)[Frontend("10.96.0.10", "TCP", 80)] == {RealServer("10.244.2.5", 8080)}


def test_no_endpoints_rejects_every_frontend() -> None:
    port = dataclasses.replace(PORT, node_port=30080, load_balancer_ips=("203.0.113.7",))
    s = state(port, ())
    assert members(s, "NO-ENDPOINTS") == {
        "10.96.0.10,tcp:80",
        "203.0.113.7,tcp:80",
        "192.0.2.10,tcp:30080",
        "198.51.100.10,tcp:30080",
    }
    assert all(not v.real_servers for v in s.virtual_servers)


def test_internal_policy_local_without_local_endpoints_drops_the_cluster_ip() -> None:
    s = state(dataclasses.replace(PORT, internal_policy_local=True), (REMOTE,))
    assert members(s, "NO-LOCAL-ENDPOINTS") == {"10.96.0.10,tcp:80"}
    assert servers(s)[Frontend("10.96.0.10", "TCP", 80)] == set()


def test_source_ranges_fill_the_firewall_sets() -> None:
    port = dataclasses.replace(
        PORT,
        load_balancer_ips=("203.0.113.7",),
        source_ranges=("198.51.100.0/24", "192.0.2.10/32"),
    )
    s = state(port, (LOCAL,))
    assert members(s, "LOAD-BALANCER-FW") == {"203.0.113.7,tcp:80"}
    assert members(s, "LOAD-BALANCER-SOURCE-CIDR") == {
        "203.0.113.7,tcp:80,198.51.100.0/24",
        "203.0.113.7,tcp:80,192.0.2.10",
        "203.0.113.7,tcp:80,203.0.113.7",
    }, "the node is inside the ranges, so the LB IP passes as a source too"
    outside = state(dataclasses.replace(port, source_ranges=("198.51.100.0/24",)), (LOCAL,))
    assert members(outside, "LOAD-BALANCER-SOURCE-CIDR") == {"203.0.113.7,tcp:80,198.51.100.0/24"}


def test_ipv6_uses_its_own_addresses_only() -> None:
    port = dataclasses.replace(PORT, external_ips=("203.0.113.5", "2001:db8::5"))
    s = state(port, (LOCAL, Endpoint("fd10::5", 8080)), CTX6)
    assert set(servers(s)) == {
        Frontend("fd00::10", "TCP", 80),
        Frontend("2001:db8::5", "TCP", 80),
    }
    assert dummy_addresses(s.members) == {"fd00::10", "2001:db8::5"}
    assert members(s, "LOOP-BACK") == {"fd10::5,tcp:8080,fd10::5"}


def test_nodeport_addresses_skip_loopback_and_link_local_unless_configured() -> None:
    local = ("127.0.0.1", "192.0.2.10", "fe80::1", "2001:db8::1", "::1", "198.51.100.10")
    assert nodeport_addresses(CTX, local) == ("192.0.2.10", "198.51.100.10")
    assert nodeport_addresses(CTX6, local) == ("2001:db8::1",)
    chosen = dataclasses.replace(CTX, nodeport_addresses=("198.51.100.10",))
    assert nodeport_addresses(chosen, local) == ("198.51.100.10",)
    link_local = dataclasses.replace(CTX6, nodeport_addresses=("fe80::1", "::1"))
    assert nodeport_addresses(link_local, local) == ("fe80::1",)


def test_nodeport_addresses_leave_out_the_dummy_links_service_addresses() -> None:
    # --nodeport-addresses 0.0.0.0/0 matched every link's address, the cluster IPs the dummy
    # link holds included; `local` (every link but the dummy) leaves those out
    everything = dataclasses.replace(
        CTX, nodeport_addresses=("10.96.0.10", "127.0.0.1", "192.0.2.10")
    )
    assert nodeport_addresses(everything, ("127.0.0.1", "192.0.2.10")) == ("192.0.2.10",)


def test_desired_counts_owners_so_shared_members_stay() -> None:
    other = ServicePortName("ns", "api", "http", "TCP")
    cluster = Frontend("10.96.0.10", "TCP", 80)
    desired = Desired()
    first = desired.update({NAME: state(PORT, (LOCAL,))})
    assert ("LOOP-BACK", "10.244.1.5,tcp:8080,10.244.1.5") in first.added_members
    assert dummy_addresses(first.added_members) == {"10.96.0.10"}
    assert first.servers == {cluster: None}
    second = desired.update({other: state(dataclasses.replace(PORT, name=other), (LOCAL,))})
    assert not second.added_members and not second.servers
    gone = desired.update({NAME: None})
    assert not gone.removed_members
    assert not gone.servers, "the other port still wants the same virtual server"
    wanted = desired.server(cluster)
    assert wanted is not None
    last = desired.update({other: None})
    assert dummy_addresses(last.removed_members) == {"10.96.0.10"}
    assert ("CLUSTER-IP", "10.96.0.10,tcp:80") in last.removed_members
    assert last.servers == {cluster: wanted}
    assert desired.server(cluster) is None
    assert not desired.members


def test_desired_batch_reports_the_net_change_and_only_changed_virtual_servers() -> None:
    other = ServicePortName("ns", "zone", "http", "TCP")
    moved = dataclasses.replace(PORT, name=other, cluster_ips=("10.96.0.11",))
    desired = Desired()
    desired.update({NAME: state(PORT, (LOCAL,)), other: state(moved, (LOCAL,))})
    delta = desired.update(
        {
            NAME: state(PORT, (LOCAL, REMOTE)),
            other: state(dataclasses.replace(moved, cluster_ips=("10.96.0.10",)), (LOCAL,)),
        }
    )
    assert delta.added_members == {("LOOP-BACK", "10.244.2.5,tcp:8080,10.244.2.5")}
    assert dummy_addresses(delta.removed_members) == {"10.96.0.11"}
    assert ("LOOP-BACK", "10.244.1.5,tcp:8080,10.244.1.5") not in delta.removed_members
    before = {RealServer("10.244.1.5", 8080)}
    assert {f: v and set(v.real_servers) for f, v in delta.servers.items()} == {
        Frontend("10.96.0.10", "TCP", 80): before,
        Frontend("10.96.0.11", "TCP", 80): before,
    }
    again = desired.update({NAME: state(PORT, (LOCAL, REMOTE))})
    assert not again.added_members and not again.removed_members and not again.servers


def test_set_names_fit_ipset_and_chains_never_collide_with_the_iptables_mode() -> None:
    for spec in names.SETS:
        for family in (4, 6):
            assert len(names.set_name(spec.key, family)) <= 31
    assert names.set_name("CLUSTER-IP", 6) == "KNIT6-CLUSTER-IP"
    for _, chain in render(CTX).chains:
        assert names.owned_chain(chain) and not owned_by_knit(chain)
        assert len(chain) <= 28


def test_rules_masquerade_off_cluster_sources_hairpin_and_reject() -> None:
    text = script(CTX)
    assert "! -s 10.244.0.0/16 -m set --match-set KNIT-CLUSTER-IP dst,dst" in text
    assert "--match-set KNIT-LOOP-BACK dst,dst,src -j MASQUERADE" in text
    assert "--match-set KNIT-NO-ENDPOINTS dst,dst -j REJECT" in text
    assert "--match-set KNIT-NO-LOCAL-ENDPOINTS dst,dst -j DROP" in text
    assert "-p tcp -m set --match-set KNIT-NODE-PORT-TCP dst -j KNIT-IPVS-MARK-MASQ" in text
    assert "-I PREROUTING 1 -m comment" in text
    assert "-j MARK --or-mark 0x4000" in text


def test_rules_script_adds_only_missing_hooks_and_removes_stale_chains_with_their_hooks() -> None:
    ctx = dataclasses.replace(CTX6, masquerade_all=True)
    snapshots = {
        "nat": TableSnapshot(set(), {("PREROUTING", names.SERVICES)}),
        "filter": TableSnapshot(
            {"KNIT-IPVS-OLD"}, {("INPUT", "KNIT-IPVS-OLD")}, ("-A INPUT -j KNIT-IPVS-OLD",)
        ),
    }
    text = script(ctx, snapshots)
    assert "KNIT6-CLUSTER-IP" in text and "KNIT-CLUSTER-IP " not in text
    assert "-I PREROUTING" not in text and "-I OUTPUT 1" in text
    assert text.index("-D INPUT -j KNIT-IPVS-OLD") < text.index("-X KNIT-IPVS-OLD")
    assert "masquerade all" in text


def test_nodeport_addresses_restrict_the_nodeport_jump() -> None:
    ctx = dataclasses.replace(CTX, nodeport_addresses=("192.0.2.10",))
    text = script(ctx)
    assert "-d 192.0.2.10 -j KNIT-IPVS-NODE-PORT" in text
    assert "--dst-type LOCAL -j KNIT-IPVS-NODE-PORT" not in text
    assert "--dst-type LOCAL -j KNIT-IPVS-NODE-PORT" in script(CTX)
    assert "--dst-type LOCAL ! -d ::1/128 -j KNIT-IPVS-NODE-PORT" in script(CTX6)


def test_without_a_cluster_cidr_connections_from_a_service_address_are_masqueraded() -> None:
    no_cidr = dataclasses.replace(CTX, cluster_cidr="")
    services = render(no_cidr).chains[("nat", names.SERVICES)]
    assert any("--match-set KNIT-CLUSTER-IP src,dst -j KNIT-IPVS-MARK-MASQ" in r for r in services)
    assert not any("src,dst" in r for r in render(CTX).chains[("nat", names.SERVICES)])


def test_rules_share_the_iptables_modes_masquerade_and_forward_chains() -> None:
    rules = render(CTX).chains
    base = render_base(CTX).chains
    assert rules[("nat", names.MARK_MASQ)] == base[("nat", ch.MARK_MASQ)]
    assert rules[("nat", names.POSTROUTING)][1:] == base[("nat", ch.POSTROUTING)]
    assert rules[("filter", names.FORWARD)] == base[("filter", ch.FORWARD)]
