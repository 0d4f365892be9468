"""Pure: the iptables rules the IPVS datapath needs in one family, as iptables-restore input.

IPVS does the load balancing; iptables only marks for masquerade (off-cluster sources to
cluster IPs, external traffic under the Cluster policy, host traffic to Local frontends),
masquerades hairpin traffic (KNIT-LOOP-BACK), drops sources outside loadBalancerSourceRanges,
rejects or drops frontends without endpoints, and refuses new connections to the dummy
link's addresses on ports no service uses. Every match is an ipset lookup, so the rules do not
grow with the number of services; they are rewritten whole when the family's settings change.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxyd.ipvs import names as n
from proxyd.plan import FamilyContext

NAT = "nat"
FILTER = "filter"
TABLES = (NAT, FILTER)
NEW = "-m conntrack --ctstate NEW"


@dataclass(frozen=True)
class Rules:
    chains: dict[tuple[str, str], tuple[str, ...]]
    """(table, chain) -> its rules (the text after `-A CHAIN`)."""
    hooks: tuple[tuple[str, str, str], ...]
    """(table, built-in chain, rule) jumps into the chains."""


def comment(text: str) -> str:
    return f'-m comment --comment "{text}"'


def match(key: str, family: int, flags: str) -> str:
    return f"-m set --match-set {n.set_name(key, family)} {flags}"


def nodeport_destinations(ctx: FamilyContext) -> tuple[str, ...]:
    if ctx.nodeport_addresses is not None:
        return tuple(f"-d {address}" for address in ctx.nodeport_addresses)
    return ("-m addrtype --dst-type LOCAL",)


def render(ctx: FamilyContext) -> Rules:
    f = ctx.family
    mark = f"{ctx.masquerade_mark:#x}"
    masq = f"-j {n.MARK_MASQ}"
    local_src = "-m addrtype --src-type LOCAL"
    icmp = "icmp" if f == 4 else "ipv6-icmp"

    services: list[str] = [
        f"{comment('load balancer IPs')} {match(n.LOAD_BALANCER_SET.key, f, 'dst,dst')}"
        f" -j {n.LOAD_BALANCER}",
    ]
    cluster = match(n.CLUSTER_IP.key, f, "dst,dst")
    if ctx.masquerade_all:
        services.append(f"{comment('masquerade all')} {cluster} {masq}")
    elif ctx.cluster_cidr:
        services.append(f"{comment('off-cluster source')} ! -s {ctx.cluster_cidr} {cluster} {masq}")
    services += [
        f"{comment('cluster IPs')} {cluster} -j ACCEPT",
        f"{comment('external IPs')} {match(n.EXTERNAL_IP.key, f, 'dst,dst')} {masq}",
        f"{comment('external IPs, Local policy, from the host')}"
        f" {match(n.EXTERNAL_IP_LOCAL.key, f, 'dst,dst')} {local_src} {masq}",
        *(
            f"{comment('node ports')} {destination} -j {n.NODE_PORT}"
            for destination in nodeport_destinations(ctx)
        ),
    ]
    nodeports: list[str] = []
    for proto in n.PROTOCOLS:
        p = f"-p {proto.lower()}"
        nodeports += [
            f"{comment(f'{proto} node ports')} {p} {match(n.NODE_PORTS[proto].key, f, 'dst')}"
            f" {masq}",
            f"{comment(f'{proto} node ports, Local policy, from the host')} {p}"
            f" {match(n.NODE_PORTS_LOCAL[proto].key, f, 'dst')} {local_src} {masq}",
        ]
    lb_local = match(n.LOAD_BALANCER_LOCAL.key, f, "dst,dst")
    chains: dict[tuple[str, str], tuple[str, ...]] = {
        (NAT, n.SERVICES): tuple(services),
        (NAT, n.NODE_PORT): tuple(nodeports),
        (NAT, n.LOAD_BALANCER): (
            f"{comment('Local policy, from the host')} {lb_local} {local_src} {masq}",
            f"{comment('Local policy keeps the source')} {lb_local} -j RETURN",
            masq,
        ),
        (NAT, n.MARK_MASQ): (f"-j MARK --or-mark {mark}",),
        (NAT, n.POSTROUTING): (
            f"{comment('hairpin')} {match(n.LOOP_BACK.key, f, 'dst,dst,src')} -j MASQUERADE",
            f"-m mark ! --mark {mark}/{mark} -j RETURN",
            f"-j MARK --xor-mark {mark}",
            f"{comment('knit service traffic requiring SNAT')} -j MASQUERADE --random-fully",
        ),
        (FILTER, n.FIREWALL): (
            f"{comment('loadBalancerSourceRanges')}"
            f" {match(n.LOAD_BALANCER_FW.key, f, 'dst,dst')} -j {n.SOURCE_RANGES}",
        ),
        (FILTER, n.SOURCE_RANGES): (
            f"{match(n.SOURCE_CIDR.key, f, 'dst,dst,src')} -j RETURN",
            f"{match(n.SOURCE_IP.key, f, 'dst,dst,src')} -j RETURN",
            "-j DROP",
        ),
        (FILTER, n.NO_ENDPOINTS): (
            f"{comment('no endpoints')} {match(n.NO_ENDPOINTS_SET.key, f, 'dst,dst')} -j REJECT",
            f"{comment('no local endpoints')}"
            f" {match(n.NO_LOCAL_ENDPOINTS.key, f, 'dst,dst')} -j DROP",
        ),
        (FILTER, n.HEALTH_CHECK): (
            f"{comment('health check node ports')} -p tcp"
            f" {match(n.HEALTH_CHECK_NODE_PORT.key, f, 'dst')} -j ACCEPT",
        ),
        (FILTER, n.FILTER): (
            f"{match(n.CLUSTER_IP.key, f, 'dst,dst')} -j RETURN",
            f"{match(n.EXTERNAL_IP.key, f, 'dst,dst')} -j RETURN",
            f"{match(n.EXTERNAL_IP_LOCAL.key, f, 'dst,dst')} -j RETURN",
            f"{match(n.LOAD_BALANCER_SET.key, f, 'dst,dst')} -j RETURN",
            f"{comment('other ports of service addresses')} {NEW} ! -p {icmp}"
            f" {match(n.IPVS_IPS.key, f, 'dst')} -j REJECT",
        ),
        (FILTER, n.FORWARD): (
            "-m conntrack --ctstate INVALID -j DROP",
            f"{comment('knit forwarding rules')} -m mark --mark {mark}/{mark} -j ACCEPT",
            f"{comment('knit forwarding conntrack rule')}"
            " -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
        ),
    }
    hooks = (
        (NAT, "PREROUTING", f"{comment('knit ipvs services')} -j {n.SERVICES}"),
        (NAT, "OUTPUT", f"{comment('knit ipvs services')} -j {n.SERVICES}"),
        (NAT, "POSTROUTING", f"{comment('knit ipvs postrouting')} -j {n.POSTROUTING}"),
        (FILTER, "INPUT", f"{NEW} {comment('knit ipvs firewall')} -j {n.FIREWALL}"),
        (FILTER, "INPUT", f"{NEW} {comment('knit ipvs no endpoints')} -j {n.NO_ENDPOINTS}"),
        (FILTER, "INPUT", f"{comment('knit ipvs health checks')} -j {n.HEALTH_CHECK}"),
        (FILTER, "INPUT", f"{comment('knit ipvs service ports')} -j {n.FILTER}"),
        (FILTER, "FORWARD", f"{NEW} {comment('knit ipvs firewall')} -j {n.FIREWALL}"),
        (FILTER, "FORWARD", f"{comment('knit ipvs forwarding')} -j {n.FORWARD}"),
        (FILTER, "OUTPUT", f"{NEW} {comment('knit ipvs firewall')} -j {n.FIREWALL}"),
        (FILTER, "OUTPUT", f"{NEW} {comment('knit ipvs no endpoints')} -j {n.NO_ENDPOINTS}"),
    )
    return Rules(chains, hooks)


def hook_target(rule: str) -> str:
    return rule.rsplit(" ", 1)[1]


def script(
    rules: Rules, existing: dict[str, set[str]], jumps: dict[str, set[tuple[str, str]]]
) -> str:
    """iptables-restore --noflush input: every chain rewritten whole, stale owned chains
    (`existing` per table) removed, and the hooks not yet in place (`jumps` per table:
    (built-in chain, target)) inserted at the top of their built-in chains."""
    lines: list[str] = []
    for table in TABLES:
        wanted = {chain: r for (tbl, chain), r in rules.chains.items() if tbl == table}
        stale = sorted(existing.get(table, set()) - wanted.keys())
        body = [f":{chain} - [0:0]" for chain in (*wanted, *stale)]
        for chain, chain_rules in wanted.items():
            body += [f"-A {chain} {rule}" for rule in chain_rules]
        for tbl, builtin, rule in reversed(rules.hooks):
            if tbl == table and (builtin, hook_target(rule)) not in jumps.get(table, set()):
                body.append(f"-I {builtin} 1 {rule}")
        body += [f"-X {chain}" for chain in stale]
        lines += [f"*{table}", *body, "COMMIT"]
    return "\n".join(lines) + "\n"
