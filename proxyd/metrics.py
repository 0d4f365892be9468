"""Metrics under kube-proxy's own names, so dashboards built for kube-proxy keep working."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

SYNC_BUCKETS = tuple(0.001 * 2**i for i in range(15))
PROGRAMMING_BUCKETS = (
    0.25,
    0.5,
    *range(1, 60),
    *range(60, 120, 5),
    *range(120, 301, 30),
)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sync_duration = Histogram(
            "kubeproxy_sync_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds",
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.full_sync_duration = Histogram(
            "kubeproxy_sync_full_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for full resyncs",
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.partial_sync_duration = Histogram(
            "kubeproxy_sync_partial_proxy_rules_duration_seconds",
            "SyncProxyRules latency in seconds for partial resyncs",
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.network_programming = Histogram(
            "kubeproxy_network_programming_duration_seconds",
            "In Cluster Network Programming Latency in seconds",
            buckets=PROGRAMMING_BUCKETS,
            registry=r,
        )
        self.last_sync = Gauge(
            "kubeproxy_sync_proxy_rules_last_timestamp_seconds",
            "The last time proxy rules were successfully synced",
            registry=r,
        )
        self.last_queued = Gauge(
            "kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds",
            "The last time a sync of proxy rules was queued",
            registry=r,
        )
        self.endpoint_changes_pending = Gauge(
            "kubeproxy_sync_proxy_rules_endpoint_changes_pending",
            "Pending proxy rules Endpoint changes",
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
            registry=r,
        )
        self.partial_restore_failures = Counter(
            "kubeproxy_sync_proxy_rules_iptables_partial_restore_failures",
            "Cumulative proxy iptables partial restore failures",
            registry=r,
        )
        self.nftables_sync_failures = Counter(
            "kubeproxy_sync_proxy_rules_nftables_sync_failures",
            "Cumulative proxy nftables sync failures",
            registry=r,
        )
        self.no_local_endpoints = Gauge(
            "kubeproxy_sync_proxy_rules_no_local_endpoints_total",
            "Number of services with a Local traffic policy and no endpoints",
            ["traffic_policy"],
            registry=r,
        )
        self.healthz = Counter(
            "kubeproxy_proxy_healthz", "Cumulative proxy healthz HTTP status", ["code"], registry=r
        )
        self.livez = Counter(
            "kubeproxy_proxy_livez", "Cumulative proxy livez HTTP status", ["code"], registry=r
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
