"""Metrics under kube-proxy's own names and labels (the `ip_family` label of kube-proxy 1.33 and
later on what one family's proxier records), so dashboards built for kube-proxy keep working;
knit's own (NetworkPolicy, which kube-proxy does not do) under `knit_`."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
PROGRAMMING_BUCKETS = (
    0.25,
    0.5,
    *range(1, 60),
    *range(60, 120, 5),
    *range(120, 301, 30),
)


FAMILY = ("ip_family",)
DENIED_LABELS = ("direction", "namespace", "policies")


class DeniedPackets(Collector):
    """Packets the policies denied, read from the kernel's counters at each scrape."""

    def __init__(self, read: Callable[[], Mapping[tuple[str, str, str], int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "knit_network_policy_denied_packets",
            "Packets dropped by a ClusterNetworkPolicy's Deny or because no NetworkPolicy "
            "isolating the pod allowed them, by direction, the pod's namespace and the "
            "policies judging the pod",
            labels=DENIED_LABELS,
        )
        for labels, packets in sorted(self._read().items()):
            family.add_metric(labels, packets)
        yield family


class LostRecords(Collector):
    """Flow records lost, by where: over the kernel's limit (its counters, read at each
    scrape) or in the socket's buffer (gaps in NFLOG's numbering)."""

    def __init__(self, read: Callable[[], Mapping[str, int]]) -> None:
        self._read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "knit_network_policy_flow_records_lost",
            "Connections a pod chain judged whose record was lost: over the rate limit, or "
            "because the daemon's socket buffer was full",
            labels=("reason",),
        )
        for reason, lost in sorted(self._read().items()):
            family.add_metric((reason,), lost)
        yield family


def family_label(family: int) -> str:
    return f"IPv{family}"


@dataclass(frozen=True)
class FamilyMetrics:
    """The series one IP family's part of a sync records (its `ip_family` label filled in)."""

    sync_duration: Histogram
    full_sync_duration: Histogram
    partial_sync_duration: Histogram
    network_programming: Histogram
    last_sync: Gauge
    last_queued: Gauge
    endpoint_changes_pending: Gauge
    restore_failures: Counter
    partial_restore_failures: Counter
    nftables_sync_failures: Counter
    no_local_internal: Gauge
    no_local_external: Gauge
    conntrack_sync_duration: Histogram
    conntrack_deleted: Counter


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            FAMILY,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.full_sync_duration = Histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            FAMILY,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.partial_sync_duration = Histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            FAMILY,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.network_programming = Histogram(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            FAMILY,
            buckets=PROGRAMMING_BUCKETS,
            registry=r,
        )
        self.last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            FAMILY,
            registry=r,
        )
        self.last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            FAMILY,
            registry=r,
        )
        self.endpoint_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
            FAMILY,
            registry=r,
        )
        self.endpoint_changes = Counter(
            "kubeproxy_sync_proxy_rules_endpoint_changes",
            "Cumulative proxy rules Endpoint changes",
            registry=r,
        )
        self.service_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_service_changes_pending",
            "Pending proxy rules Service changes",
            registry=r,
        )
        self.service_changes = Counter(
            "kubeproxy_sync_proxy_rules_service_changes",
            "Cumulative proxy rules Service changes",
            registry=r,
        )
        self.iptables_total = Gauge(
            "kubeproxy_sync_proxy_rules_iptables_total",
            "Total number of iptables rules owned by the proxy",
            ["table", "ip_family"],
            registry=r,
        )
        self.iptables_last = Gauge(
            "kubeproxy_sync_proxy_rules_iptables_last",
            "Number of iptables rules written by the proxy in the last sync",
            ["table", "ip_family"],
            registry=r,
        )
        self.restore_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_restore_failures",
            "Cumulative proxy iptables restore failures",
            FAMILY,
            registry=r,
        )
        self.partial_restore_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
            "Cumulative proxy iptables partial restore failures",
            FAMILY,
            registry=r,
        )
        self.nftables_sync_failures = Counter(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "Cumulative proxy nftables sync failures",
            FAMILY,
            registry=r,
        )
        self.no_local_endpoints = Gauge(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            ["traffic_policy", "ip_family"],
            registry=r,
        )
        self.conntrack_sync_duration = Histogram(
            "kubeproxy_conntrack_reconciler_sync_duration_seconds",
            "ReconcileConntrackFlowsLatency latency in seconds",
            FAMILY,
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.conntrack_deleted = Counter(
            "kubeproxy_conntrack_reconciler_deleted_entries",
            "Cumulative conntrack flows deleted by conntrack reconciler",
            FAMILY,
            registry=r,
        )
        self.healthz = Counter(
            "kubeproxy_proxy_healthz", "Cumulative proxy healthz HTTP status", ["code"], registry=r
        )
        self.livez = Counter(
            "kubeproxy_proxy_livez", "Cumulative proxy livez HTTP status", ["code"], registry=r
        )
        self.policy_sync_duration = Histogram(
            "knit_network_policy_sync_duration_seconds",
            "Time to compile the policies and write the changes to the kernel",
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.refused_service_ports = Gauge(
            "knit_sync_proxy_rules_refused_service_ports",
            "Service ports left out of the rules because the kernel refused them",
            FAMILY,
            registry=r,
        )
        self.policy_last_sync = Gauge(
            "knit_network_policy_sync_last_timestamp_seconds",
            "The last time a family's policy table was successfully synced",
            FAMILY,
            registry=r,
        )
        self.policy_sync_failures = Counter(
            "knit_network_policy_sync_failures",
            "Cumulative policy syncs of a family that failed",
            FAMILY,
            registry=r,
        )
        self.policy_quarantined = Gauge(
            "knit_network_policy_quarantined_pods",
            "Pod chains dropping all traffic because nft refused their rules",
            FAMILY,
            registry=r,
        )
        self.policy_cut_connections = Counter(
            "knit_network_policy_cut_connections",
            "Cumulative open connections cut because a policy change denies them",
            FAMILY,
            registry=r,
        )
        self.policy_cut_duration = Histogram(
            "knit_network_policy_cut_duration_seconds",
            "Time to read a family's conntrack table after a policy change and mark the "
            "entries the policies deny",
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.policy_connections = Counter(
            "knit_network_policy_connections",
            "New connections judged by a pod chain, from their flow records (records under the "
            "rate limit: see knit_network_policy_flow_records_lost_total), by what decided "
            "them and the verdict",
            ["kind", "namespace", "name", "verdict"],
            registry=r,
        )
        self.policy_staged_connections = Counter(
            "knit_network_policy_staged_connections",
            "Flow records whose connection staged policies would decide otherwise (another "
            "verdict or another deciding rule), by what would decide them and the verdict "
            "they would get",
            ["kind", "namespace", "name", "verdict"],
            registry=r,
        )
        self._families: dict[int, FamilyMetrics] = {}

    def count_denied(self, read: Callable[[], Mapping[tuple[str, str, str], int]]) -> None:
        self.registry.register(DeniedPackets(read))

    def count_lost_records(self, read: Callable[[], Mapping[str, int]]) -> None:
        self.registry.register(LostRecords(read))

    def for_family(self, family: int) -> FamilyMetrics:
        """One family's series; the first ask creates them, so they read 0 before the first
        event."""
        if family not in self._families:
            self._families[family] = self._make_family(family_label(family))
        return self._families[family]

    def _make_family(self, label: str) -> FamilyMetrics:
        return FamilyMetrics(
            sync_duration=self.sync_duration.labels(label),
            full_sync_duration=self.full_sync_duration.labels(label),
            partial_sync_duration=self.partial_sync_duration.labels(label),
            network_programming=self.network_programming.labels(label),
            last_sync=self.last_sync.labels(label),
            last_queued=self.last_queued.labels(label),
            endpoint_changes_pending=self.endpoint_changes_pending.labels(label),
            restore_failures=self.restore_failures.labels(label),
            partial_restore_failures=self.partial_restore_failures.labels(label),
            nftables_sync_failures=self.nftables_sync_failures.labels(label),
            no_local_internal=self.no_local_endpoints.labels("internal", label),
            no_local_external=self.no_local_endpoints.labels("external", label),
            conntrack_sync_duration=self.conntrack_sync_duration.labels(label),
            conntrack_deleted=self.conntrack_deleted.labels(label),
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
