"""What every datapath shares (proxyd.proxier.Proxier), driven through a datapath that only
records what it was asked to write: failures per family, health-check counts, and which UDP
flows a sync leaves alone."""

from __future__ import annotations

import dataclasses
import socket

import pytest

from proxyd import conntrack
from proxyd.conntrack import Frontends
from proxyd.metrics import Metrics
from proxyd.model import Endpoint, ServicePort, ServicePortName
from proxyd.port_plan import FamilyContext
from proxyd.proxier import Plans, ProgramError, Proxier, ProxyOptions
from proxyd.tracker import Changes
from tests.support.example_service import NAME, NODE, PORT, READY, changes


class RecordingProxier(Proxier):
    mode = "recording"

    def __init__(self, families: tuple[int, ...]) -> None:
        super().__init__(ProxyOptions(), families, Metrics())
        self.written: dict[int, Plans] = {}
        self.refusing: set[int] = set()
        """Families whose next write fails."""

    def _program(
        self, ctx: FamilyContext, plans: Plans, changed: set[ServicePortName], full: bool
    ) -> bool:
        if ctx.family in self.refusing:
            self.refusing.discard(ctx.family)
            raise ProgramError(f"IPv{ctx.family} refused")
        self.written[ctx.family] = dict(plans)
        return full

    def cleanup(self) -> int:
        return 0


def test_a_family_refused_leaves_the_other_written_and_catches_up_by_a_full_sync() -> None:
    proxier = RecordingProxier((4, 6))
    proxier.sync(Changes(services={}, node=NODE))
    proxier.refusing.add(4)
    dual = (*READY, Endpoint("fd10::5", 8080))
    with pytest.raises(ProgramError, match="IPv4 refused"):
        proxier.sync(changes((PORT, dual)))
    assert NAME in proxier.written[6]
    assert NAME not in proxier.written[4]
    result = proxier.sync(Changes(services={}, node=NODE))
    assert result.full
    assert NAME in proxier.written[4]


def lb_port(name: str, node_port: int) -> ServicePort:
    return dataclasses.replace(
        PORT,
        name=dataclasses.replace(NAME, port=name),
        port=node_port - 30000,
        node_port=node_port,
        load_balancer_ips=("203.0.113.7",),
        external_policy_local=True,
        health_check_node_port=32000,
    )


def test_health_check_counts_ready_local_endpoints_over_the_services_ports() -> None:
    terminating = Endpoint("10.244.1.6", 8080, ready=False, terminating=True, node_name="node-a")
    elsewhere = Endpoint("10.244.2.5", 8080, node_name="node-b")
    here = Endpoint("10.244.1.5", 8080, node_name="node-a")
    proxier = RecordingProxier((4,))
    draining = proxier.sync(changes((lb_port("http", 30080), (terminating, elsewhere))))
    assert draining.health_checks == {32000: ("ns", "web", 0)}
    both = proxier.sync(
        changes(
            (lb_port("http", 30080), (terminating, elsewhere, here)),
            (lb_port("https", 30443), (here,)),
        )
    )
    assert both.health_checks == {32000: ("ns", "web", 2)}


def test_udp_flows_to_any_serving_endpoint_are_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    cleared: list[Frontends] = []

    def clear_stale(frontends: Frontends) -> int:
        cleared.append(frontends)
        return 2

    monkeypatch.setattr(conntrack, "clear_stale", clear_stale)
    port = dataclasses.replace(
        PORT, name=dataclasses.replace(NAME, protocol="UDP"), internal_policy_local=True
    )
    endpoints = (
        Endpoint("10.244.1.5", 53, node_name="node-a"),
        Endpoint("10.244.2.5", 53, node_name="node-b"),
        Endpoint("10.244.1.6", 53, ready=False, terminating=True, node_name="node-a"),
        Endpoint("10.244.1.7", 53, ready=False, serving=False, terminating=True),
    )
    proxier = RecordingProxier((4,))
    proxier.sync(changes((port, endpoints)))
    assert cleared == [], "the reconciler's thread cleans, not the sync"
    proxier.reconciler.reconcile()
    (frontends,) = cleared
    served = {("10.244.1.5", 53), ("10.244.2.5", 53), ("10.244.1.6", 53)}
    assert frontends.by_address == {("10.96.0.10", 80): served}
    assert frontends.stale(("10.96.0.10", 80), ("10.244.1.7", 53))
    assert sample(proxier, "kubeproxy_conntrack_reconciler_deleted_entries_total", 4) == 2
    assert sample(proxier, "kubeproxy_conntrack_reconciler_sync_duration_seconds_count", 4) == 1


def sample(proxier: Proxier, name: str, family: int, **labels: str) -> float | None:
    return proxier.metrics.registry.get_sample_value(name, {"ip_family": f"IPv{family}", **labels})


def test_each_family_records_its_own_sync_metrics_as_kube_proxys_per_family_proxiers_do() -> None:
    proxier = RecordingProxier((4, 6))
    for family in (4, 6):
        assert (
            sample(proxier, "kubeproxy_sync_proxy_rules_iptables_restore_failures_total", family)
            == 0
        )
    proxier.sync(Changes(services={}, node=NODE))
    proxier.refusing.add(6)
    local = dataclasses.replace(PORT, internal_policy_local=True)
    elsewhere = (Endpoint("10.244.2.5", 8080, node_name="node-b"), Endpoint("fd10::5", 8080))
    timed = Changes(
        services=changes((local, elsewhere)).services, node=NODE, trigger_times={4: [1.0]}
    )
    with pytest.raises(ProgramError, match="IPv6 refused") as refused:
        proxier.sync(timed)
    assert refused.value.families == {6}
    full, partial = (
        f"kubeproxy_sync_{k}_proxy_rules_duration_seconds_count" for k in ("full", "partial")
    )
    assert (sample(proxier, full, 4), sample(proxier, partial, 4)) == (1, 1)
    assert (sample(proxier, full, 6), sample(proxier, partial, 6)) == (1, 0)
    assert sample(proxier, "kubeproxy_network_programming_duration_seconds_count", 4) == 1
    assert sample(proxier, "kubeproxy_network_programming_duration_seconds_count", 6) == 0
    failures = "kubeproxy_sync_proxy_rules_iptables_{}restore_failures_total"
    assert sample(proxier, failures.format(""), 6) == 1
    assert sample(proxier, failures.format("partial_"), 6) == 1
    assert sample(proxier, failures.format(""), 4) == 0
    no_local = "kubeproxy_sync_proxy_rules_no_local_endpoints_total"
    assert sample(proxier, no_local, 4, traffic_policy="internal") == 1
    assert sample(proxier, no_local, 6, traffic_policy="internal") == 0


def test_tcp_frontends_of_changed_ports_lose_entries_no_serving_endpoint_answered(
    unanswered_cleared: list[dict[int, Frontends]], monkeypatch: pytest.MonkeyPatch
) -> None:
    tcp = socket.IPPROTO_TCP
    proxier = RecordingProxier((4,))
    proxier.sync(changes((PORT, READY)))
    proxier.reconciler.reconcile()
    [first] = unanswered_cleared
    assert first[tcp].by_address == {
        ("10.96.0.10", 80): {("10.244.1.5", 8080), ("10.244.2.5", 8080)}
    }
    assert first[tcp].stale(("10.96.0.10", 80), ("10.96.0.10", 80)), "not DNATed"
    assert not first[tcp].stale(("10.96.0.10", 80), ("10.244.1.5", 8080))
    proxier.sync(changes((PORT, READY[:1])))
    proxier.reconciler.reconcile()
    assert unanswered_cleared[1][tcp].stale(("10.96.0.10", 80), ("10.244.2.5", 8080)), "gone"
    proxier.sync(Changes(services={}, node=NODE))
    proxier.reconciler.reconcile()
    assert len(unanswered_cleared) == 2, "a sync that changes no port cleans nothing"
    udp = dataclasses.replace(PORT, name=dataclasses.replace(NAME, port="dns", protocol="UDP"))
    monkeypatch.setattr(conntrack, "clear_stale", lambda frontends: 0)
    proxier.sync(changes((udp, READY)))
    proxier.reconciler.reconcile()
    assert len(unanswered_cleared) == 2, "UDP entries are the stale clean-up's"
