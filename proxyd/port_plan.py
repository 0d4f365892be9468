"""Pure: what one service port needs in one address family, decided once for every datapath.

Each proxier (iptables, nftables, IPVS) turns a PortPlan into its own rules; what a port's
traffic should meet (which endpoints, drop or reject, masquerade, firewall) is decided here,
so the modes cannot drift apart.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from proxyd.model import Endpoint, NodeInfo, ServicePort, family_of
from proxyd.topology import categorize


@dataclass(frozen=True, slots=True)
class FamilyContext:
    """Node-wide settings of one address family."""

    family: int
    node: NodeInfo
    cluster_cidr: str = ""
    """Pod CIDR of this family for detect-local; empty: no local detection."""
    masquerade_all: bool = False
    masquerade_mark: int = 0x4000
    nodeport_addresses: tuple[str, ...] | None = None
    """Node addresses NodePorts answer on; None: every local address."""
    localhost_nodeports: bool = True
    drop_invalid: bool = True
    service_cidrs: tuple[str, ...] = ()
    """The ranges of this family cluster IPs come from (the ServiceCIDR objects')."""

    def of_family(self, address: str) -> bool:
        """For addresses and CIDRs the model already validated."""
        return family_of(address) == self.family


@dataclass(frozen=True, slots=True)
class PortPlan:
    """One service port in one family: its frontends and the endpoints behind them."""

    port: ServicePort
    cluster_ip: str
    external_ips: tuple[str, ...]
    load_balancer_ips: tuple[str, ...]
    source_ranges: tuple[str, ...]
    cluster: tuple[Endpoint, ...]
    """Endpoints Cluster-policy traffic goes to (empty when no policy is Cluster)."""
    local: tuple[Endpoint, ...]
    """This node's endpoints for Local-policy traffic (empty when no policy is Local)."""
    reachable: tuple[Endpoint, ...]
    """Every endpoint some rule may send traffic to."""
    has_endpoints: bool
    """A usable endpoint exists somewhere: without one, every frontend rejects."""
    node_in_source_ranges: bool
    """The node itself is inside loadBalancerSourceRanges (so the LB IP as source passes)."""

    @property
    def has_internal(self) -> bool:
        """Cluster-IP traffic has somewhere to go (else: reject, or drop under Local)."""
        return self.has_endpoints and (not self.port.internal_policy_local or bool(self.local))

    @property
    def has_external(self) -> bool:
        """External traffic has somewhere to go (else: reject, or drop under Local)."""
        return self.has_endpoints and (not self.port.external_policy_local or bool(self.local))

    @property
    def internal_endpoints(self) -> tuple[Endpoint, ...]:
        return self.local if self.port.internal_policy_local else self.cluster

    @property
    def external_endpoints(self) -> tuple[Endpoint, ...]:
        return self.local if self.port.external_policy_local else self.cluster

    @property
    def uses_external(self) -> bool:
        """External frontends (NodePort, external and LB IPs) lead somewhere."""
        return self.has_endpoints and self.port.externally_accessible

    @property
    def uses_firewall(self) -> bool:
        """Source ranges of this family limit its LB IPs (ranges of the other family alone leave
        them open, as kube-proxy's per-family proxiers do)."""
        return self.has_endpoints and bool(self.load_balancer_ips) and bool(self.source_ranges)

    @property
    def no_endpoint_verdict(self) -> str:
        """What frontends without endpoints do: reject with no endpoint anywhere, drop when
        only the Local policy finds none here."""
        return "drop" if self.has_endpoints else "reject"

    @property
    def no_local_internal(self) -> bool:
        return self.has_endpoints and self.port.internal_policy_local and not self.local

    @property
    def no_local_external(self) -> bool:
        return (
            self.has_endpoints
            and self.port.external_policy_local
            and self.port.externally_accessible
            and not self.local
        )

    @property
    def firewall_sources(self) -> tuple[str, ...]:
        """Sources the LB firewall lets through."""
        if self.node_in_source_ranges:
            return (*self.source_ranges, *self.load_balancer_ips)
        return self.source_ranges


def plan_port(
    port: ServicePort, endpoints: tuple[Endpoint, ...], ctx: FamilyContext
) -> PortPlan | None:
    """The port's plan in ctx's family; None when it has no cluster IP there."""
    cluster_ip = next((ip for ip in port.cluster_ips if ctx.of_family(ip)), None)
    if cluster_ip is None:
        return None
    endpoints = tuple(e for e in endpoints if ctx.of_family(e.ip))
    categorized = categorize(port, endpoints, ctx.node)
    source_ranges = tuple(cidr for cidr in port.source_ranges if ctx.of_family(cidr))
    node_inside = bool(source_ranges) and any(
        ipaddress.ip_address(a) in ipaddress.ip_network(cidr)
        for a in ctx.node.addresses
        if ctx.of_family(a)
        for cidr in source_ranges
    )
    return PortPlan(
        port=port,
        cluster_ip=cluster_ip,
        external_ips=tuple(ip for ip in port.external_ips if ctx.of_family(ip)),
        load_balancer_ips=tuple(ip for ip in port.load_balancer_ips if ctx.of_family(ip)),
        source_ranges=source_ranges,
        cluster=categorized.cluster,
        local=categorized.local,
        reachable=categorized.reachable,
        has_endpoints=categorized.any_usable,
        node_in_source_ranges=node_inside,
    )
