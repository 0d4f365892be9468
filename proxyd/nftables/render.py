"""Pure rendering: port plans of one family -> the nftables objects they need.

One table per family (`ip knit`, `ip6 knit`). A service port lives in map and set elements,
not in rules: new connections find their frontend through verdict maps keyed on
address . protocol . port (protocol . port for NodePorts), masquerade through sets of
frontends, and an endpoint through a shared `spread-...-N` chain that draws a random index
below N (the frontend's endpoint count) and DNATs to the endpoint map's element for
frontend . index. So the first packet costs the same at 10 services as at 10,000, and a change
to one service adds and removes elements only (or points its frontend at another spread
chain): the kernel validates every chain reachable from the hooks after a transaction that
adds a jump or a DNAT, and nft reads every chain before each transaction, so both stay cheap
because the table holds few chains and rules whatever the number of services.

Two kinds of service port own chains: session affinity (a cascade over per-endpoint timed
sets, `service-`/`local-` chains) and loadBalancerSourceRanges (`firewall-` chains). Behaviour
matches the iptables mode: reject when no endpoint exists, drop when a Local policy finds
none here, the same masquerade marks, the firewall, and affinity.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from cni import ip_text
from proxyd.model import PROTOCOLS as SERVICE_PROTOCOLS
from proxyd.model import Endpoint, ServicePortName
from proxyd.naming import NFT_NAME_MAX, short_hash, within
from proxyd.port_plan import FamilyContext, PortPlan

TABLE = "knit"

SERVICE_IPS = "service-ips"
SERVICE_NODEPORTS = "service-nodeports"
NO_ENDPOINT_SERVICES = "no-endpoint-services"
NO_ENDPOINT_EXTERNAL = "no-endpoint-external"
NO_ENDPOINT_NODEPORTS = "no-endpoint-nodeports"
FIREWALL_IPS = "firewall-ips"
HAIRPIN = "hairpin"
"""Endpoint . endpoint: a connection DNATed back to its own source is masqueraded."""
MASQUERADE_IPS = "masquerade-ips"
"""Address frontends whose traffic is always masqueraded."""
MASQUERADE_NODEPORTS = "masquerade-nodeports"
CLUSTER_IPS = "cluster-ips"
"""Cluster-IP frontends, masqueraded when the source is outside the cluster CIDR."""
CLUSTER_ADDRESSES = "cluster-addresses"
"""Every cluster IP, whatever its ports: a new connection still addressed to one after DNAT
went to a port no Service declares, and is rejected, as kube-proxy's nftables mode does."""

SERVICES = "services"
NODEPORTS = "nodeports"
MARK_MASQ = "mark-for-masquerade"
MASQUERADING = "masquerading"
REJECT = "reject-chain"
CLUSTER_IPS_CHECK = "cluster-ips-check"
UNDECLARED_PORTS_CHECK = "undeclared-ports-check"
EXTERNAL_CHECK = "external-services-check"
FIREWALL_CHECK = "firewall-check"

Rules = tuple[str, ...]


PROTOCOLS = tuple(protocol.lower() for protocol in SERVICE_PROTOCOLS)
"""As nft names them."""


@dataclass(frozen=True, order=True, slots=True)
class FrontendKind:
    """Address frontends (cluster, external and LB IPs) or NodePorts: how their key is read
    from a packet and the maps and chains keyed that way."""

    name: str
    dispatch: str
    """Frontend -> where its connections go."""
    unreachable: str
    """Frontend -> what happens without an endpoint to go to."""
    masquerade: str
    by_address: bool
    """Keyed by destination address . protocol . port; else by protocol . port."""

    @property
    def external_local(self) -> str:
        """Shared chain choosing between cluster and local endpoints for a Local policy."""
        return f"external-local-{self.name}"

    def spread_map(self, local: bool) -> str:
        """Frontend -> its spread, for a Local policy's external traffic."""
        return f"{'local' if local else 'cluster'}-spread-{self.name}"

    def endpoint_map(self, local: bool, proto: str) -> str:
        """Frontend . index -> endpoint address . port, one map per protocol: nft 1.0.6
        cannot use a map whose `typeof` data reads `th dport` once the map is in the kernel."""
        return f"{'local-' if local else ''}endpoints-{self.name}-{proto}"

    def key(self, l3: str) -> str:
        """The frontend as a dispatch map's key."""
        address = f"{l3} daddr . " if self.by_address else ""
        return f"{address}meta l4proto . th dport"

    def endpoint_key(self, l3: str, proto: str) -> str:
        """The frontend as an endpoint map's key, the random index left out."""
        address = f"{l3} daddr . " if self.by_address else ""
        return f"{address}{proto} dport"


IPS = FrontendKind("ips", SERVICE_IPS, NO_ENDPOINT_EXTERNAL, MASQUERADE_IPS, by_address=True)
NODEPORT_KIND = FrontendKind(
    "nodeports", SERVICE_NODEPORTS, NO_ENDPOINT_NODEPORTS, MASQUERADE_NODEPORTS, by_address=False
)


@dataclass(frozen=True, order=True, slots=True)
class Spread:
    """The shared chain sending a new connection to one of `count` endpoints of its frontend,
    at random, through the endpoint map of the frontend's kind and protocol."""

    frontends: FrontendKind
    local: bool
    proto: str
    count: int

    @property
    def name(self) -> str:
        kind = self.frontends.name
        return f"spread-{'local-' if self.local else ''}{kind}-{self.proto}-{self.count}"

    def rules(self, family: int) -> Rules:
        l3, _ = address_words(family)
        key = self.frontends.endpoint_key(l3, self.proto)
        endpoints = self.frontends.endpoint_map(self.local, self.proto)
        return (
            f"meta l4proto {self.proto} dnat to {key} . numgen random mod {self.count} "
            f"map @{endpoints}",
        )


@dataclass(frozen=True, slots=True)
class ServiceObjects:
    """What one service port owns or uses in one family's table."""

    chains: dict[str, Rules] = field(default_factory=dict)
    elements: dict[str, dict[str, str]] = field(default_factory=dict)
    """Map -> key -> the value (a verdict, or an endpoint) the port wants there."""
    members: dict[str, frozenset[str]] = field(default_factory=dict)
    """Plain set -> the elements the port wants in it."""
    sets: dict[str, str] = field(default_factory=dict)
    """Affinity sets: name -> declaration."""
    spreads: frozenset[Spread] = frozenset()
    """Shared spread chains its frontends go to."""


@dataclass(frozen=True, slots=True)
class BaseObjects:
    """The table's fixed part: maps, hooked chains and the shared helper chains."""

    maps: dict[str, str]
    """name -> declaration of the maps and sets services fill."""
    chains: dict[str, Rules]
    hooks: dict[str, str]
    """chain name -> its base-chain declaration (type, hook, priority)."""


def family_name(family: int) -> str:
    return "ip" if family == 4 else "ip6"


def table_of(family: int, table: str = TABLE) -> str:
    """A table as nft names it in a command: family and name."""
    return f"{family_name(family)} {table}"


def address_words(family: int) -> tuple[str, str]:
    """(the l3 match keyword, the address type)."""
    return ("ip", "ipv4_addr") if family == 4 else ("ip6", "ipv6_addr")


class ServiceNames:
    """Names of one service port's own chains and sets; hashed prefix, readable suffix (cut
    to nft's limit, which the API server's limits on names keep them within today). Only
    ports with affinity or a firewall have any, so the hash is computed on first use."""

    def __init__(self, name: ServicePortName) -> None:
        self._name = name
        self._base = f"{name.namespace}/{name.name}/{name.protocol.lower()}/{name.port}"

    @cached_property
    def _hash(self) -> str:
        return short_hash(f"{self._name}{self._name.protocol.lower()}", 8)

    @property
    def cluster(self) -> str:
        return within(f"service-{self._hash}-{self._base}", NFT_NAME_MAX)

    @property
    def local(self) -> str:
        return within(f"local-{self._hash}-{self._base}", NFT_NAME_MAX)

    @property
    def firewall(self) -> str:
        return within(f"firewall-{self._hash}-{self._base}", NFT_NAME_MAX)

    def affinity(self, endpoint: Endpoint, timeout: int) -> str:
        """The endpoint's affinity set, named after the timeout too: a new timeout makes a
        new set (nft names take no ':', so IPv6 colons become dots)."""
        digest = short_hash(f"{self._base}{endpoint}/{timeout}", 8)
        ip = endpoint.ip.replace(":", ".")
        return within(f"affinity-{digest}-{self._base}__{ip}/{endpoint.port}", NFT_NAME_MAX)


def _sticky(plan: PortPlan, endpoints: tuple[Endpoint, ...], names: ServiceNames, l3: str) -> Rules:
    """Session affinity: the endpoint remembered for the source, else one at random (endpoint
    i with probability 1/(count - i)), remembered from then on."""
    proto = plan.port.protocol.lower()
    timeout = plan.port.affinity_timeout

    def to(endpoint: Endpoint) -> str:
        remember = f"update @{names.affinity(endpoint, timeout)} {{ {l3} saddr }} "
        return f"{remember}meta l4proto {proto} dnat to {endpoint}"

    rules = [f"{l3} saddr @{names.affinity(e, timeout)} {to(e)}" for e in endpoints]
    count = len(endpoints)
    for index, endpoint in enumerate(endpoints[:-1]):
        rules.append(f"numgen random mod {count - index} 0 {to(endpoint)}")
    rules.append(to(endpoints[-1]))
    return tuple(rules)


@dataclass(frozen=True, slots=True)
class PortContext:
    """What a service port's objects depend on besides its plan: the family and settings fixed
    for the daemon's life, nothing about the node (the plan holds what the node decides)."""

    family: int
    cluster_cidr: str
    masquerade_all: bool

    @classmethod
    def of(cls, ctx: FamilyContext) -> PortContext:
        return cls(ctx.family, ctx.cluster_cidr, ctx.masquerade_all)


class Renderer:
    """Renders one family's service ports, keeping a port's objects while its plan and the
    context stay equal: a full sync re-renders only the ports that changed (a plan compares
    cheaply, its endpoints being the tracker's own objects)."""

    def __init__(self) -> None:
        self._ctx: PortContext | None = None
        self._rendered: dict[ServicePortName, tuple[PortPlan, ServiceObjects]] = {}

    def begin_full(self, plans: Mapping[ServicePortName, PortPlan], ctx: PortContext) -> None:
        """A full sync's start: forget the ports not in `plans`, and every port rendered in
        another context."""
        kept = self._rendered if ctx == self._ctx else {}
        self._ctx = ctx
        self._rendered = {name: kept[name] for name in plans if name in kept}

    def render(
        self, plans: Mapping[ServicePortName, PortPlan], names: Iterable[ServicePortName]
    ) -> dict[ServicePortName, ServiceObjects]:
        """The objects of the ports named, every one in `plans`, in the last context."""
        rendered: dict[ServicePortName, ServiceObjects] = {}
        for name in names:
            self._rendered[name] = self._render(plans[name], self._rendered.get(name))
            rendered[name] = self._rendered[name][1]
        return rendered

    def render_changed(
        self, plans: Mapping[ServicePortName, PortPlan], names: Iterable[ServicePortName]
    ) -> dict[ServicePortName, ServiceObjects | None]:
        """The objects of the ports named (None: gone from `plans`), in the last context."""
        changed: dict[ServicePortName, ServiceObjects | None] = {}
        for name in names:
            if name in plans:
                changed.update(self.render(plans, (name,)))
            else:
                self._rendered.pop(name, None)
                changed[name] = None
        return changed

    def _render(
        self, plan: PortPlan, kept: tuple[PortPlan, ServiceObjects] | None
    ) -> tuple[PortPlan, ServiceObjects]:
        assert self._ctx is not None
        if kept is not None and kept[0] == plan:
            return plan, kept[1]
        return plan, render_service(plan, self._ctx)


def render_service(plan: PortPlan, ctx: PortContext) -> ServiceObjects:
    port = plan.port
    names = ServiceNames(port.name)
    l3, addr_type = address_words(ctx.family)
    proto = port.protocol.lower()
    chains: dict[str, Rules] = {}
    elements: dict[str, dict[str, str]] = {}
    members: dict[str, set[str]] = {}
    spreads: set[Spread] = set()

    def element(map_name: str, key: str, value: str) -> None:
        elements.setdefault(map_name, {})[key] = value

    def spread(kind: FrontendKind, frontend: str, local: bool) -> str:
        """The verdict taking new connections to `frontend` (address . port, or the node
        port) to its endpoints."""
        endpoints = plan.local if local else plan.cluster
        if port.affinity_timeout:
            chain = names.local if local else names.cluster
            chains[chain] = _sticky(plan, endpoints, names, l3)
            return f"goto {chain}"
        shared = Spread(kind, local, proto, len(endpoints))
        spreads.add(shared)
        targets = elements.setdefault(kind.endpoint_map(local, proto), {})
        for index, endpoint in enumerate(endpoints):
            targets[f"{frontend} . {index}"] = f"{endpoint.ip} . {endpoint.port}"
        return f"goto {shared.name}"

    def member(set_name: str, key: str) -> None:
        members.setdefault(set_name, set()).add(key)

    no_endpoints = "drop" if plan.no_endpoint_verdict == "drop" else f"goto {REJECT}"

    cluster_key = f"{plan.cluster_ip} . {proto} . {port.port}"
    member(CLUSTER_ADDRESSES, plan.cluster_ip)
    if plan.has_internal:
        to_endpoints = spread(IPS, f"{plan.cluster_ip} . {port.port}", port.internal_policy_local)
        element(SERVICE_IPS, cluster_key, to_endpoints)
        if ctx.masquerade_all:
            member(MASQUERADE_IPS, cluster_key)
        elif ctx.cluster_cidr:
            member(CLUSTER_IPS, cluster_key)
    else:
        element(NO_ENDPOINT_SERVICES, cluster_key, no_endpoints)

    def external(kind: FrontendKind, key: str, frontend: str) -> None:
        if plan.has_endpoints and port.external_policy_local:
            element(kind.dispatch, key, f"goto {kind.external_local}")
            if plan.cluster:
                element(kind.spread_map(False), key, spread(kind, frontend, False))
            if plan.local:
                element(kind.spread_map(True), key, spread(kind, frontend, True))
        elif plan.has_endpoints and plan.cluster:
            member(kind.masquerade, key)
            element(kind.dispatch, key, spread(kind, frontend, False))
        if not plan.has_external:
            element(kind.unreachable, key, no_endpoints)

    for ip in (*plan.external_ips, *plan.load_balancer_ips):
        external(IPS, f"{ip} . {proto} . {port.port}", f"{ip} . {port.port}")
    if port.node_port:
        external(NODEPORT_KIND, f"{proto} . {port.node_port}", str(port.node_port))
    if plan.uses_firewall:
        for ip in plan.load_balancer_ips:
            element(FIREWALL_IPS, f"{ip} . {proto} . {port.port}", f"goto {names.firewall}")
        sources = ", ".join(plan.firewall_sources)
        allowed = f"{l3} saddr != {{ {sources} }} " if sources else ""
        chains[names.firewall] = (f"{allowed}counter drop",)

    if plan.reachable:
        members[HAIRPIN] = {f"{e.ip} . {e.ip}" for e in plan.reachable}
    sets: dict[str, str] = {}
    if port.affinity_timeout:
        for endpoint in plan.reachable:
            sets[names.affinity(endpoint, port.affinity_timeout)] = (
                f"{{ type {addr_type} ; flags dynamic,timeout ; "
                f"timeout {port.affinity_timeout}s ; }}"
            )

    return ServiceObjects(
        chains=chains,
        elements=elements,
        members={name: frozenset(keys) for name, keys in members.items()},
        sets=sets,
        spreads=frozenset(spreads),
    )


def _nodeport_match(ctx: FamilyContext) -> str | None:
    """The destination match NodePorts answer on; None: on no address at all."""
    l3, _ = address_words(ctx.family)
    if ctx.nodeport_addresses is not None:
        if not ctx.nodeport_addresses:
            return None
        return f"{l3} daddr {{ {', '.join(ctx.nodeport_addresses)} }}"
    if ctx.family == 6:
        return "fib daddr type local ip6 daddr != ::1"
    if ctx.localhost_nodeports:
        return "fib daddr type local"
    return "fib daddr type local ip daddr != 127.0.0.0/8"


def render_base(ctx: FamilyContext) -> BaseObjects:
    l3, addr_type = address_words(ctx.family)
    mark = f"{ctx.masquerade_mark:#x}"
    by_address = f"{{ type {addr_type} . inet_proto . inet_service : verdict ; }}"
    by_port = "{ type inet_proto . inet_service : verdict ; }"
    maps = {
        SERVICE_IPS: by_address,
        SERVICE_NODEPORTS: by_port,
        NO_ENDPOINT_SERVICES: by_address,
        NO_ENDPOINT_EXTERNAL: by_address,
        NO_ENDPOINT_NODEPORTS: by_port,
        FIREWALL_IPS: by_address,
        HAIRPIN: f"{{ type {addr_type} . {addr_type} ; }}",
        MASQUERADE_IPS: f"{{ type {addr_type} . inet_proto . inet_service ; }}",
        MASQUERADE_NODEPORTS: "{ type inet_proto . inet_service ; }",
        CLUSTER_IPS: f"{{ type {addr_type} . inet_proto . inet_service ; }}",
        CLUSTER_ADDRESSES: f"{{ type {addr_type} ; }}",
    }
    for kind, declaration in ((IPS, by_address), (NODEPORT_KIND, by_port)):
        for local in (False, True):
            maps[kind.spread_map(local)] = declaration
            for proto in PROTOCOLS:
                key = f"{kind.endpoint_key(l3, proto)} . numgen random mod 1"
                maps[kind.endpoint_map(local, proto)] = (
                    f"{{ typeof {key} : {l3} daddr . {proto} dport ; }}"
                )
    address_key = IPS.key(l3)
    port_key = NODEPORT_KIND.key(l3)
    nodeports = _nodeport_match(ctx)
    services = [f"{address_key} @{MASQUERADE_IPS} jump {MARK_MASQ}"]
    if ctx.cluster_cidr and not ctx.masquerade_all:
        services.append(
            f"{address_key} @{CLUSTER_IPS} {l3} saddr != {ctx.cluster_cidr} jump {MARK_MASQ}"
        )
    services.append(f"{address_key} vmap @{SERVICE_IPS}")
    new = "ct state new"
    input_rules = [f"{new} jump {EXTERNAL_CHECK}"]
    if nodeports is not None:
        services.append(f"{nodeports} jump {NODEPORTS}")
        # A NodePort left without endpoints is a packet for the node itself: input sees it.
        input_rules.append(f"{new} {nodeports} {port_key} vmap @{NO_ENDPOINT_NODEPORTS}")
    output_rules = [f"{new} jump {FIREWALL_CHECK}", f"{new} jump {CLUSTER_IPS_CHECK}"]
    # An address of the service ranges no Service holds would be routed on, maybe to a host
    # outside that happens to own it: dropped, as kube-proxy's nftables mode does.
    unallocated = (
        (f"{l3} daddr {{ {', '.join(_collapsed(ctx.service_cidrs))} }} drop",)
        if ctx.service_cidrs
        else ()
    )
    if ctx.family == 4 and ctx.localhost_nodeports:
        input_rules.append(f"{new} ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 drop")
    chains: dict[str, Rules] = {
        SERVICES: tuple(services),
        NODEPORTS: (
            f"{port_key} @{MASQUERADE_NODEPORTS} jump {MARK_MASQ}",
            f"{port_key} vmap @{SERVICE_NODEPORTS}",
        ),
        IPS.external_local: _external_local(IPS, ctx),
        NODEPORT_KIND.external_local: _external_local(NODEPORT_KIND, ctx),
        MARK_MASQ: (f"meta mark set meta mark | {mark}",),
        MASQUERADING: (
            f"ct status dnat {l3} saddr . {l3} daddr @{HAIRPIN} masquerade fully-random",
            f"meta mark & {mark} == 0 return",
            f"meta mark set meta mark ^ {mark}",
            "masquerade fully-random",
        ),
        REJECT: ("reject",),
        CLUSTER_IPS_CHECK: (f"{address_key} vmap @{NO_ENDPOINT_SERVICES}",),
        UNDECLARED_PORTS_CHECK: (f"{l3} daddr @{CLUSTER_ADDRESSES} reject", *unallocated),
        EXTERNAL_CHECK: (f"{address_key} vmap @{NO_ENDPOINT_EXTERNAL}",),
        FIREWALL_CHECK: (f"{address_key} vmap @{FIREWALL_IPS}",),
        "nat-prerouting": (f"jump {SERVICES}",),
        "nat-output": (f"jump {SERVICES}",),
        "nat-postrouting": (f"jump {MASQUERADING}",),
        "filter-prerouting": (f"{new} jump {FIREWALL_CHECK}",),
        "filter-input": tuple(input_rules),
        "filter-forward": (
            *(("ct state invalid drop",) if ctx.drop_invalid else ()),
            f"{new} jump {CLUSTER_IPS_CHECK}",
            f"{new} jump {EXTERNAL_CHECK}",
            f"{new} jump {UNDECLARED_PORTS_CHECK}",
        ),
        "filter-output": tuple(output_rules),
        # After nat-output's DNAT (-100), unlike filter-output: a declared port's connection
        # no longer goes to the cluster IP there.
        "filter-output-post-dnat": (f"{new} jump {UNDECLARED_PORTS_CHECK}",),
    }
    hooks = {
        "nat-prerouting": "type nat hook prerouting priority dstnat",
        "nat-output": "type nat hook output priority -100",
        "nat-postrouting": "type nat hook postrouting priority srcnat",
        "filter-prerouting": "type filter hook prerouting priority dstnat - 10",
        "filter-input": "type filter hook input priority filter - 10",
        "filter-forward": "type filter hook forward priority filter - 10",
        "filter-output": "type filter hook output priority -110",
        "filter-output-post-dnat": "type filter hook output priority -90",
    }
    return BaseObjects(maps=maps, chains=chains, hooks=hooks)


def _collapsed(cidrs: Iterable[str]) -> list[str]:
    """The ranges without overlaps, which an anonymous interval set refuses."""
    return [str(net) for net in ip_text.collapsed(ipaddress.ip_network(c) for c in cidrs)]


def _external_local(kind: FrontendKind, ctx: FamilyContext) -> Rules:
    """External traffic of a Local-policy frontend: pods and the node itself may use any
    endpoint (the node's own traffic masqueraded), the rest only this node's."""
    l3, _ = address_words(ctx.family)
    to_cluster = f"{kind.key(l3)} vmap @{kind.spread_map(False)}"
    from_pods = [f"{l3} saddr {ctx.cluster_cidr} {to_cluster}"] if ctx.cluster_cidr else []
    return (
        *from_pods,
        f"fib saddr type local jump {MARK_MASQ}",
        f"fib saddr type local {to_cluster}",
        f"{kind.key(l3)} vmap @{kind.spread_map(True)}",
    )
