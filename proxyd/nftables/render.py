"""Pure rendering: port plans of one family -> the nftables objects they need.

One table per family (`ip knit`, `ip6 knit`). New connections find their service through
verdict maps keyed on address . protocol . port (and protocol . port for NodePorts), so the
first packet costs the same at 10 services as at 10,000; each service port owns its chains
(service-, local-, external-, firewall-) and map elements, so a change to one
service rewrites only those. Behaviour matches the iptables mode rule for rule: reject when
no endpoint exists, drop when a Local policy finds none here, the same masquerade marks, the
loadBalancerSourceRanges firewall, and session affinity through per-endpoint dynamic sets.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxyd.model import Endpoint, ServicePortName
from proxyd.naming import short_hash
from proxyd.plan import FamilyContext, PortPlan

TABLE = "knit"

SERVICE_IPS = "service-ips"
SERVICE_NODEPORTS = "service-nodeports"
NO_ENDPOINT_SERVICES = "no-endpoint-services"
NO_ENDPOINT_EXTERNAL = "no-endpoint-external"
NO_ENDPOINT_NODEPORTS = "no-endpoint-nodeports"
FIREWALL_IPS = "firewall-ips"
HAIRPIN = "hairpin"
"""Endpoint . endpoint: a connection DNATed back to its own source is masqueraded."""

SERVICES = "services"
MARK_MASQ = "mark-for-masquerade"
MASQUERADING = "masquerading"
REJECT = "reject-chain"
CLUSTER_IPS_CHECK = "cluster-ips-check"
EXTERNAL_CHECK = "external-services-check"
FIREWALL_CHECK = "firewall-check"

Rules = tuple[str, ...]
Element = tuple[str, str]
"""(key, verdict) of a verdict-map element; the verdict is empty in a plain set."""


@dataclass(frozen=True)
class ServiceObjects:
    """What one service port owns in one family's table."""

    chains: dict[str, Rules] = field(default_factory=dict)
    elements: dict[str, frozenset[Element]] = field(default_factory=dict)
    sets: dict[str, str] = field(default_factory=dict)
    """Affinity sets: name -> declaration."""


@dataclass(frozen=True)
class BaseObjects:
    """The table's fixed part: maps, hooked chains and the shared helper chains."""

    maps: dict[str, str]
    """name -> declaration of the maps and sets services fill."""
    chains: dict[str, Rules]
    hooks: dict[str, str]
    """chain name -> its base-chain declaration (type, hook, priority)."""


def family_name(family: int) -> str:
    return "ip" if family == 4 else "ip6"


def _addr(family: int) -> tuple[str, str]:
    """(the l3 match keyword, the address type)."""
    return ("ip", "ipv4_addr") if family == 4 else ("ip6", "ipv6_addr")


class ServiceNames:
    """Names of one service port's chains and sets; hashed prefix, readable suffix."""

    def __init__(self, name: ServicePortName) -> None:
        proto = name.protocol.lower()
        self._base = f"{name.namespace}/{name.name}/{proto}/{name.port}"
        self._hash = short_hash(f"{name}{proto}", 8)
        self.cluster = f"service-{self._hash}-{self._base}"
        self.local = f"local-{self._hash}-{self._base}"
        self.external = f"external-{self._hash}-{self._base}"
        self.firewall = f"firewall-{self._hash}-{self._base}"

    def affinity(self, endpoint: Endpoint, timeout: int) -> str:
        """The endpoint's affinity set, named after the timeout too: a new timeout makes a
        new set (nft names take no ':', so IPv6 colons become dots)."""
        digest = short_hash(f"{self._base}{endpoint}/{timeout}", 8)
        ip = endpoint.ip.replace(":", ".")
        return f"affinity-{digest}-{self._base}__{ip}/{endpoint.port}"


def _dnat_target(endpoint: Endpoint) -> str:
    if ":" in endpoint.ip:
        return f"[{endpoint.ip}]:{endpoint.port}"
    return f"{endpoint.ip}:{endpoint.port}"


def _spread(
    plan: PortPlan, endpoints: tuple[Endpoint, ...], names: ServiceNames, l3: str
) -> list[str]:
    """Rules sending a new connection to one endpoint: the remembered one under affinity,
    else one at random.

    The random choice is a cascade (endpoint i with probability 1/(count - i)) ending in the
    DNAT itself, not a numgen into an anonymous verdict map and per-endpoint chains: the
    kernel's loop check walks every set of the table for each jump it adds, and nft reads
    every chain of the family before each transaction, so both would make the cost of a
    change grow with the number of services."""
    proto = plan.port.protocol.lower()
    timeout = plan.port.affinity_timeout

    def to(endpoint: Endpoint) -> str:
        remember = (
            f"update @{names.affinity(endpoint, timeout)} {{ {l3} saddr }} " if timeout else ""
        )
        return f"{remember}meta l4proto {proto} dnat to {_dnat_target(endpoint)}"

    rules = []
    if timeout:
        rules += [f"{l3} saddr @{names.affinity(e, timeout)} {to(e)}" for e in endpoints]
    count = len(endpoints)
    for index, endpoint in enumerate(endpoints[:-1]):
        rules.append(f"numgen random mod {count - index} 0 {to(endpoint)}")
    rules.append(to(endpoints[-1]))
    return rules


def render_service(plan: PortPlan, ctx: FamilyContext) -> ServiceObjects:
    port = plan.port
    names = ServiceNames(port.name)
    l3, addr_type = _addr(ctx.family)
    proto = port.protocol.lower()
    chains: dict[str, list[str]] = {}
    elements: dict[str, set[Element]] = {}

    def element(map_name: str, key: str, verdict: str) -> None:
        elements.setdefault(map_name, set()).add((key, verdict))

    no_endpoints = "drop" if plan.no_endpoint_verdict == "drop" else f"goto {REJECT}"
    internal_chain = names.local if port.internal_policy_local else names.cluster
    external_policy_chain = names.local if port.external_policy_local else names.cluster

    cluster_key = f"{plan.cluster_ip} . {proto} . {port.port}"
    if plan.has_internal:
        element(SERVICE_IPS, cluster_key, f"goto {internal_chain}")
        match = f"{l3} daddr {plan.cluster_ip} {proto} dport {port.port}"
        if ctx.masquerade_all:
            chains.setdefault(internal_chain, []).append(f"{match} jump {MARK_MASQ}")
        elif ctx.cluster_cidr:
            chains.setdefault(internal_chain, []).append(
                f"{match} {l3} saddr != {ctx.cluster_cidr} jump {MARK_MASQ}"
            )
    else:
        element(NO_ENDPOINT_SERVICES, cluster_key, no_endpoints)

    def external_frontend(dispatch: str, unreachable: str, key: str) -> None:
        if plan.has_endpoints:
            element(dispatch, key, f"goto {names.external}")
        if not plan.has_external:
            element(unreachable, key, no_endpoints)

    for ip in (*plan.external_ips, *plan.load_balancer_ips):
        external_frontend(SERVICE_IPS, NO_ENDPOINT_EXTERNAL, f"{ip} . {proto} . {port.port}")
    if plan.uses_firewall:
        for ip in plan.load_balancer_ips:
            element(FIREWALL_IPS, f"{ip} . {proto} . {port.port}", f"goto {names.firewall}")
        sources = ", ".join(plan.firewall_sources)
        allowed = f"{l3} saddr != {{ {sources} }} " if sources else ""
        chains[names.firewall] = [f"{allowed}counter drop"]

    if port.node_port:
        external_frontend(SERVICE_NODEPORTS, NO_ENDPOINT_NODEPORTS, f"{proto} . {port.node_port}")

    if plan.uses_external:
        rules = chains.setdefault(names.external, [])
        if not port.external_policy_local:
            rules.append(f"jump {MARK_MASQ}")
        else:
            if ctx.cluster_cidr and plan.cluster:
                rules.append(f"{l3} saddr {ctx.cluster_cidr} goto {names.cluster}")
            rules.append(f"fib saddr type local jump {MARK_MASQ}")
            if plan.cluster:
                rules.append(f"fib saddr type local goto {names.cluster}")
        if plan.has_external:
            rules.append(f"goto {external_policy_chain}")

    if plan.cluster:
        chains.setdefault(names.cluster, []).extend(_spread(plan, plan.cluster, names, l3))
    if plan.local:
        chains.setdefault(names.local, []).extend(_spread(plan, plan.local, names, l3))
    sets: dict[str, str] = {}
    for endpoint in plan.reachable:
        element(HAIRPIN, f"{endpoint.ip} . {endpoint.ip}", "")
        if port.affinity_timeout:
            sets[names.affinity(endpoint, port.affinity_timeout)] = (
                f"{{ type {addr_type} ; flags dynamic,timeout ; "
                f"timeout {port.affinity_timeout}s ; }}"
            )

    return ServiceObjects(
        chains={name: tuple(rules) for name, rules in chains.items()},
        elements={name: frozenset(items) for name, items in elements.items()},
        sets=sets,
    )


def _nodeport_match(ctx: FamilyContext) -> str | None:
    """The destination match NodePorts answer on; None: on no address at all."""
    l3, _ = _addr(ctx.family)
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
    l3, addr_type = _addr(ctx.family)
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
    }
    dispatch = f"{l3} daddr . meta l4proto . th dport vmap"
    nodeports = _nodeport_match(ctx)
    services = [f"{dispatch} @{SERVICE_IPS}"]
    external_check = [f"{dispatch} @{NO_ENDPOINT_EXTERNAL}"]
    if nodeports is not None:
        services.append(f"{nodeports} meta l4proto . th dport vmap @{SERVICE_NODEPORTS}")
        external_check.append(f"{nodeports} meta l4proto . th dport vmap @{NO_ENDPOINT_NODEPORTS}")
    new = "ct state new"
    input_rules = [f"{new} jump {EXTERNAL_CHECK}"]
    output_rules = [f"{new} jump {FIREWALL_CHECK}", f"{new} jump {CLUSTER_IPS_CHECK}"]
    if ctx.family == 4 and ctx.localhost_nodeports:
        input_rules.append(f"{new} ip daddr 127.0.0.0/8 ip saddr != 127.0.0.0/8 drop")
    chains: dict[str, Rules] = {
        SERVICES: tuple(services),
        MARK_MASQ: (f"meta mark set meta mark | {mark}",),
        MASQUERADING: (
            f"ct status dnat {l3} saddr . {l3} daddr @{HAIRPIN} masquerade fully-random",
            f"meta mark & {mark} == 0 return",
            f"meta mark set meta mark ^ {mark}",
            "masquerade fully-random",
        ),
        REJECT: ("reject",),
        CLUSTER_IPS_CHECK: (f"{dispatch} @{NO_ENDPOINT_SERVICES}",),
        EXTERNAL_CHECK: tuple(external_check),
        FIREWALL_CHECK: (f"{dispatch} @{FIREWALL_IPS}",),
        "nat-prerouting": (f"jump {SERVICES}",),
        "nat-output": (f"jump {SERVICES}",),
        "nat-postrouting": (f"jump {MASQUERADING}",),
        "filter-prerouting": (f"{new} jump {FIREWALL_CHECK}",),
        "filter-input": tuple(input_rules),
        "filter-forward": (
            "ct state invalid drop",
            f"{new} jump {CLUSTER_IPS_CHECK}",
            f"{new} jump {EXTERNAL_CHECK}",
        ),
        "filter-output": tuple(output_rules),
    }
    hooks = {
        "nat-prerouting": "type nat hook prerouting priority dstnat",
        "nat-output": "type nat hook output priority -100",
        "nat-postrouting": "type nat hook postrouting priority srcnat",
        "filter-prerouting": "type filter hook prerouting priority dstnat - 10",
        "filter-input": "type filter hook input priority filter - 10",
        "filter-forward": "type filter hook forward priority filter - 10",
        "filter-output": "type filter hook output priority -110",
    }
    return BaseObjects(maps=maps, chains=chains, hooks=hooks)
