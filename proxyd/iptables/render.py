"""Pure rendering: the model of one address family -> the iptables rules it needs.

The layout follows kube-proxy's iptables mode (per-service SVC/SVL/EXT/FW chains, per-endpoint
SEP chains, dispatch from KNIT-SERVICES and KNIT-NODEPORTS, drops and rejects in the filter
table), with KNIT- names. A rule is the text after `-A CHAIN`, in the form iptables-restore
reads, so the same text adds (`-A`/`-I`) and deletes (`-D`) it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxyd.iptables import chains as ch
from proxyd.model import Endpoint, ServicePort
from proxyd.naming import XT_COMMENT_MAX, within
from proxyd.port_plan import FamilyContext, PortPlan

NAT = "nat"
FILTER = "filter"
TABLES = (NAT, FILTER)
NEW = "-m conntrack --ctstate NEW"

Rules = tuple[str, ...]
SharedKey = tuple[str, str]
"""(table, chain) of a chain every service adds rules to."""
SHARED_CHAINS: tuple[SharedKey, ...] = (
    (NAT, ch.SERVICES),
    (NAT, ch.NODEPORTS),
    (FILTER, ch.SERVICES),
    (FILTER, ch.EXTERNAL_SERVICES),
    (FILTER, ch.NODEPORTS),
    (FILTER, ch.PROXY_FIREWALL),
)


def nodeport_destinations(ctx: FamilyContext) -> list[str]:
    """Match arguments selecting the destinations NodePorts answer on."""
    if ctx.nodeport_addresses is not None:
        return [f"-d {address}" for address in ctx.nodeport_addresses]
    if ctx.family == 6:
        return ["-m addrtype --dst-type LOCAL ! -d ::1/128"]
    if ctx.localhost_nodeports:
        return ["-m addrtype --dst-type LOCAL"]
    return ["-m addrtype --dst-type LOCAL ! -d 127.0.0.0/8"]


@dataclass(frozen=True)
class ServiceRules:
    """What one service port contributes in one family."""

    chains: dict[str, Rules] = field(default_factory=dict)
    """Its own nat chains, whole."""
    shared: dict[SharedKey, Rules] = field(default_factory=dict)
    """Its rules in chains every service shares; their order there does not matter."""


@dataclass(frozen=True)
class BaseRules:
    """Chains independent of any service, and the fixed tail rules of the shared chains."""

    chains: dict[SharedKey, Rules]
    hooks: tuple[tuple[str, str, str], ...]
    """(table, built-in chain, rule) jumps into the proxy's chains."""


def hook_target(rule: str) -> str:
    """The chain a hook rule jumps to (its last word)."""
    return rule.rsplit(" ", 1)[1]


def comment(text: str) -> str:
    return f'-m comment --comment "{within(text, XT_COMMENT_MAX)}"'


def _endpoint_rules(
    port: ServicePort, endpoints: tuple[Endpoint, ...], seps: dict[Endpoint, str]
) -> list[str]:
    rules: list[str] = []
    if port.affinity_timeout:
        for endpoint in endpoints:
            sep = seps[endpoint]
            rules.append(
                f"{comment(f'{port.name} -> {endpoint}')} -m recent --name {sep} --rcheck"
                f" --seconds {port.affinity_timeout} --reap -j {sep}"
            )
    count = len(endpoints)
    for index, endpoint in enumerate(endpoints):
        statistic = ""
        if index < count - 1:
            statistic = f" -m statistic --mode random --probability {1.0 / (count - index):.10f}"
        rules.append(f"{comment(f'{port.name} -> {endpoint}')}{statistic} -j {seps[endpoint]}")
    return rules


def _endpoint_chain(port: ServicePort, endpoint: Endpoint, sep: str, proto: str) -> Rules:
    affinity = f" -m recent --name {sep} --set" if port.affinity_timeout else ""
    return (
        f"{comment(str(port.name))} -s {endpoint.ip} -j {ch.MARK_MASQ}",
        f"{comment(str(port.name))}{affinity} {proto} -j DNAT --to-destination {endpoint}",
    )


def render_service(plan: PortPlan, ctx: FamilyContext) -> ServiceRules:
    port = plan.port
    chains = ch.ServiceChains(port.name)
    proto_name = port.protocol.lower()
    proto = f"-p {proto_name} -m {proto_name}"
    name = str(port.name)

    uses_cluster_chain = bool(plan.cluster)
    uses_local_chain = bool(plan.local)
    internal_chain = chains.local if port.internal_policy_local else chains.cluster
    external_policy_chain = chains.local if port.external_policy_local else chains.cluster
    lb_chain = chains.firewall if plan.uses_firewall else chains.external
    verdict = plan.no_endpoint_verdict.upper()
    internal_target = "" if plan.has_internal else verdict
    external_target = "" if plan.has_external else verdict

    shared: dict[SharedKey, list[str]] = {}

    def share(table: str, chain: str, rule: str) -> None:
        shared.setdefault((table, chain), []).append(rule)

    own: dict[str, list[str]] = {}

    cluster_match = (
        f"{comment(f'{name} cluster IP')} {proto} -d {plan.cluster_ip} --dport {port.port}"
    )
    if plan.has_internal:
        share(NAT, ch.SERVICES, f"{cluster_match} -j {internal_chain}")
        if ctx.masquerade_all:
            own.setdefault(internal_chain, []).append(f"{cluster_match} -j {ch.MARK_MASQ}")
        elif ctx.cluster_cidr:
            own.setdefault(internal_chain, []).append(
                f"{cluster_match} ! -s {ctx.cluster_cidr} -j {ch.MARK_MASQ}"
            )
    else:
        share(FILTER, ch.SERVICES, f"{cluster_match} -j {internal_target}")

    for external_ip in plan.external_ips:
        match = f"{comment(f'{name} external IP')} {proto} -d {external_ip} --dport {port.port}"
        if plan.has_endpoints:
            share(NAT, ch.SERVICES, f"{match} -j {chains.external}")
        if external_target:
            share(FILTER, ch.EXTERNAL_SERVICES, f"{match} -j {external_target}")

    for lb_ip in plan.load_balancer_ips:
        match = f"{comment(f'{name} loadbalancer IP')} {proto} -d {lb_ip} --dport {port.port}"
        if plan.has_endpoints:
            share(NAT, ch.SERVICES, f"{match} -j {lb_chain}")
        if plan.uses_firewall:
            share(FILTER, ch.PROXY_FIREWALL, f"{match} -j DROP")
        if external_target:
            share(FILTER, ch.EXTERNAL_SERVICES, f"{match} -j {external_target}")

    if port.node_port:
        match = f"{comment(name)} {proto} --dport {port.node_port}"
        if plan.has_endpoints:
            share(NAT, ch.NODEPORTS, f"{match} -j {chains.external}")
        if external_target:
            for destination in nodeport_destinations(ctx):
                share(FILTER, ch.EXTERNAL_SERVICES, f"{match} {destination} -j {external_target}")

    if port.health_check_node_port:
        share(
            FILTER,
            ch.NODEPORTS,
            f"{comment(f'{name} health check node port')} -p tcp -m tcp"
            f" --dport {port.health_check_node_port} -j ACCEPT",
        )

    if plan.uses_external:
        rules = own.setdefault(chains.external, [])
        if not port.external_policy_local:
            what = f"masquerade traffic for {name} external destinations"
            rules.append(f"{comment(what)} -j {ch.MARK_MASQ}")
        else:
            if ctx.cluster_cidr and uses_cluster_chain:
                rules.append(
                    f"{comment(f'pod traffic for {name} external destinations')}"
                    f" -s {ctx.cluster_cidr} -j {chains.cluster}"
                )
            rules.append(
                f"{comment(f'masquerade LOCAL traffic for {name} external destinations')}"
                f" -m addrtype --src-type LOCAL -j {ch.MARK_MASQ}"
            )
            if uses_cluster_chain:
                rules.append(
                    f"{comment(f'route LOCAL traffic for {name} external destinations')}"
                    f" -m addrtype --src-type LOCAL -j {chains.cluster}"
                )
        if plan.has_external:
            rules.append(f"-j {external_policy_chain}")

    if plan.uses_firewall:
        rules = own.setdefault(chains.firewall, [])
        match = comment(f"{name} loadbalancer IP")
        for source in plan.firewall_sources:
            rules.append(f"{match} -s {source} -j {chains.external}")

    seps = {endpoint: chains.endpoint(endpoint) for endpoint in plan.reachable}
    if uses_cluster_chain:
        own.setdefault(chains.cluster, []).extend(_endpoint_rules(port, plan.cluster, seps))
    if uses_local_chain:
        own.setdefault(chains.local, []).extend(_endpoint_rules(port, plan.local, seps))
    for endpoint, sep in seps.items():
        own[sep] = list(_endpoint_chain(port, endpoint, sep, proto))

    return ServiceRules(
        chains={chain: tuple(rules) for chain, rules in own.items()},
        shared={key: tuple(rules) for key, rules in shared.items()},
    )


def _mark(ctx: FamilyContext) -> str:
    return f"{ctx.masquerade_mark:#x}"


def mark_masq_rules(ctx: FamilyContext) -> Rules:
    """The masquerade-mark chain: traffic jumping there is masqueraded at postrouting."""
    return (f"-j MARK --or-mark {_mark(ctx)}",)


def postrouting_rules(ctx: FamilyContext) -> Rules:
    """The postrouting chain's tail: masquerade marked traffic, clearing the mark."""
    mark = _mark(ctx)
    return (
        f"-m mark ! --mark {mark}/{mark} -j RETURN",
        f"-j MARK --xor-mark {mark}",
        f"{comment('knit service traffic requiring SNAT')} -j MASQUERADE --random-fully",
    )


def forward_rules(ctx: FamilyContext) -> Rules:
    """The forward chain: drop invalid packets (unless conntrack is liberal), accept marked
    and established traffic."""
    mark = _mark(ctx)
    return (
        *(("-m conntrack --ctstate INVALID -j DROP",) if ctx.drop_invalid else ()),
        f"{comment('knit forwarding rules')} -m mark --mark {mark}/{mark} -j ACCEPT",
        f"{comment('knit forwarding conntrack rule')}"
        " -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    )


def render_base(ctx: FamilyContext) -> BaseRules:
    nodeport_jumps = tuple(
        f"{comment('knit service nodeports; NOTE: this must be the last rule in this chain')}"
        f" {destination} -j {ch.NODEPORTS}"
        for destination in nodeport_destinations(ctx)
    )
    localnet = ctx.family == 4 and ctx.localhost_nodeports
    chains: dict[SharedKey, Rules] = {
        (NAT, ch.SERVICES): nodeport_jumps,
        (NAT, ch.NODEPORTS): (),
        (NAT, ch.MARK_MASQ): mark_masq_rules(ctx),
        (NAT, ch.POSTROUTING): postrouting_rules(ctx),
        (FILTER, ch.SERVICES): (),
        (FILTER, ch.EXTERNAL_SERVICES): (),
        (FILTER, ch.NODEPORTS): (),
        (FILTER, ch.PROXY_FIREWALL): (),
        (FILTER, ch.FORWARD): forward_rules(ctx),
    }
    if localnet:
        chains[(FILTER, ch.LOCALNET_FIREWALL)] = (
            f"{comment('block incoming localnet connections')} -d 127.0.0.0/8 ! -s 127.0.0.0/8"
            " -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP",
        )
    hooks = [
        (FILTER, "INPUT", f"{NEW} {comment('knit load balancer firewall')} -j {ch.PROXY_FIREWALL}"),
        (FILTER, "INPUT", f"{comment('knit health check service ports')} -j {ch.NODEPORTS}"),
        (
            FILTER,
            "INPUT",
            f"{NEW} {comment('knit externally-visible service portals')} -j {ch.EXTERNAL_SERVICES}",
        ),
        (
            FILTER,
            "FORWARD",
            f"{NEW} {comment('knit load balancer firewall')} -j {ch.PROXY_FIREWALL}",
        ),
        (FILTER, "FORWARD", f"{comment('knit forwarding rules')} -j {ch.FORWARD}"),
        (FILTER, "FORWARD", f"{NEW} {comment('knit service portals')} -j {ch.SERVICES}"),
        (
            FILTER,
            "FORWARD",
            f"{NEW} {comment('knit externally-visible service portals')} -j {ch.EXTERNAL_SERVICES}",
        ),
        (
            FILTER,
            "OUTPUT",
            f"{NEW} {comment('knit load balancer firewall')} -j {ch.PROXY_FIREWALL}",
        ),
        (FILTER, "OUTPUT", f"{NEW} {comment('knit service portals')} -j {ch.SERVICES}"),
        (NAT, "PREROUTING", f"{comment('knit service portals')} -j {ch.SERVICES}"),
        (NAT, "OUTPUT", f"{comment('knit service portals')} -j {ch.SERVICES}"),
        (NAT, "POSTROUTING", f"{comment('knit postrouting rules')} -j {ch.POSTROUTING}"),
    ]
    if localnet:
        hooks += [
            (FILTER, "INPUT", f"-j {ch.LOCALNET_FIREWALL}"),
            (FILTER, "OUTPUT", f"-j {ch.LOCALNET_FIREWALL}"),
        ]
    return BaseRules(chains=chains, hooks=tuple(hooks))
