"""Pure: the iptables rules the IPVS datapath needs in one family, as the base rules the
iptables mode's restore scripts write (iptables/restore.py).

IPVS does the load balancing; iptables only marks for masquerade (off-cluster sources to
cluster IPs, external traffic under the Cluster policy, host traffic to Local frontends),
masquerades hairpin traffic (KNIT-LOOP-BACK), drops sources outside loadBalancerSourceRanges,
rejects or drops frontends without endpoints, and refuses new connections to the dummy
link's addresses on ports no service uses. Every match is an ipset lookup, so the rules do not
grow with the number of services; every full sync rewrites them whole (a change of the
family's settings forces one).
"""

from __future__ import annotations

from proxyd.iptables.render import (
    FILTER,
    NAT,
    NEW,
    BaseRules,
    Rules,
    SharedKey,
    comment,
    forward_rules,
    mark_masq_rules,
    nodeport_destinations,
    postrouting_rules,
)
from proxyd.ipvs import names as n
from proxyd.port_plan import FamilyContext


def match(key: str, family: int, flags: str) -> str:
    return f"-m set --match-set {n.set_name(key, family)} {flags}"


def render(ctx: FamilyContext) -> BaseRules:
    f = ctx.family
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
    else:
        # Without a cluster CIDR, at least the node's own connections: the dummy link holds
        # every cluster IP, so the node picks the service address itself as their source.
        services.append(
            f"{comment('from a service address')} {match(n.CLUSTER_IP.key, f, 'src,dst')} {masq}"
        )
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
    chains: dict[SharedKey, Rules] = {
        (NAT, n.SERVICES): tuple(services),
        (NAT, n.NODE_PORT): tuple(nodeports),
        (NAT, n.LOAD_BALANCER): (
            f"{comment('Local policy, from the host')} {lb_local} {local_src} {masq}",
            f"{comment('Local policy keeps the source')} {lb_local} -j RETURN",
            masq,
        ),
        (NAT, n.MARK_MASQ): mark_masq_rules(ctx),
        (NAT, n.POSTROUTING): (
            f"{comment('hairpin')} {match(n.LOOP_BACK.key, f, 'dst,dst,src')} -j MASQUERADE",
            *postrouting_rules(ctx),
        ),
        (FILTER, n.FIREWALL): (
            f"{comment('loadBalancerSourceRanges')}"
            f" {match(n.LOAD_BALANCER_FW.key, f, 'dst,dst')} -j {n.SOURCE_RANGES}",
        ),
        (FILTER, n.SOURCE_RANGES): (
            f"{match(n.SOURCE_CIDR.key, f, 'dst,dst,src')} -j RETURN",
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
        (FILTER, n.FORWARD): forward_rules(ctx),
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
    return BaseRules(chains, hooks)
