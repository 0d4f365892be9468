"""Pure: the PortPlans of one family -> the IPVS state they need.

Each service port becomes virtual servers (cluster IP, external IPs, LB IPs, and its NodePort
on every node address) with their real servers, and its ipset members as `ipset` writes them
("10.96.0.10,tcp:80"); the IPVS-IPS members are the addresses the dummy link must hold.
`Desired` adds the ports up, counting owners, so a partial sync learns which members appear or
go and which virtual servers change.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from proxyd.ipvs import names
from proxyd.model import Endpoint, ServicePortName
from proxyd.port_plan import FamilyContext, PortPlan

Member = tuple[str, str]
"""(set key, entry)."""


@dataclass(frozen=True, order=True)
class Frontend:
    """What identifies a virtual server."""

    address: str
    protocol: str
    port: int


@dataclass(frozen=True, order=True)
class RealServer:
    ip: str
    port: int


@dataclass(frozen=True)
class VirtualServer:
    frontend: Frontend
    scheduler: str
    timeout: int
    """Persistence (ClientIP affinity) in seconds; 0: none."""
    real_servers: frozenset[RealServer]


@dataclass(frozen=True)
class PortState:
    virtual_servers: tuple[VirtualServer, ...] = ()
    members: frozenset[Member] = frozenset()


def dummy_addresses(members: Iterable[Member]) -> set[str]:
    """The addresses the dummy link holds for these members: their IPVS-IPS entries."""
    return {entry for key, entry in members if key == names.IPVS_IPS.key}


def nodeport_addresses(ctx: FamilyContext, local: Iterable[str]) -> tuple[str, ...]:
    """Where NodePort virtual servers listen: the node's addresses on links other than the
    dummy (`local`) but loopback, narrowed by --nodeport-addresses when given (whose CIDRs
    were matched against every link's addresses, the dummy's service addresses included),
    else without link-local ones."""
    usable = {a for a in local if ctx.of_family(a) and not ipaddress.ip_address(a).is_loopback}
    if ctx.nodeport_addresses is not None:
        return tuple(sorted(usable & set(ctx.nodeport_addresses)))
    return tuple(sorted(a for a in usable if not ipaddress.ip_address(a).is_link_local))


def _net(cidr: str) -> str:
    """ipset writes a host network as a bare address."""
    network = ipaddress.ip_network(cidr)
    if network.prefixlen == network.max_prefixlen:
        return str(network.network_address)
    return str(network)


def _real(endpoints: tuple[Endpoint, ...]) -> frozenset[RealServer]:
    return frozenset(RealServer(e.ip, e.port) for e in endpoints)


def port_state(
    plan: PortPlan, ctx: FamilyContext, scheduler: str, node_addresses: tuple[str, ...]
) -> PortState:
    """Everything one service port needs; node_addresses from nodeport_addresses()."""
    port = plan.port
    proto = port.protocol
    lower = proto.lower()
    servers: list[VirtualServer] = []
    members: set[Member] = set()
    verdict = (
        names.NO_LOCAL_ENDPOINTS.key
        if plan.no_endpoint_verdict == "drop"
        else names.NO_ENDPOINTS_SET.key
    )

    def serve(address: str, number: int, endpoints: tuple[Endpoint, ...]) -> None:
        frontend = Frontend(address, proto, number)
        servers.append(VirtualServer(frontend, scheduler, port.affinity_timeout, _real(endpoints)))

    def entry(address: str, number: int = port.port) -> str:
        return f"{address},{lower}:{number}"

    serve(plan.cluster_ip, port.port, plan.internal_endpoints if plan.has_internal else ())
    members.add((names.CLUSTER_IP.key, entry(plan.cluster_ip)))
    if not plan.has_internal:
        members.add((verdict, entry(plan.cluster_ip)))

    external = plan.external_endpoints if plan.has_external else ()
    local_policy = port.external_policy_local
    for ip in plan.external_ips:
        serve(ip, port.port, external)
        key = names.EXTERNAL_IP_LOCAL if local_policy else names.EXTERNAL_IP
        members.add((key.key, entry(ip)))
        if not plan.has_external:
            members.add((verdict, entry(ip)))
    for ip in plan.load_balancer_ips:
        serve(ip, port.port, external)
        members.add((names.LOAD_BALANCER_SET.key, entry(ip)))
        if local_policy:
            members.add((names.LOAD_BALANCER_LOCAL.key, entry(ip)))
        if plan.uses_firewall:
            members.add((names.LOAD_BALANCER_FW.key, entry(ip)))
            members.update(
                (names.SOURCE_CIDR.key, f"{entry(ip)},{_net(source)}")
                for source in plan.firewall_sources
            )
        if not plan.has_external:
            members.add((verdict, entry(ip)))
    if port.node_port:
        nodeports = names.NODE_PORTS_LOCAL if local_policy else names.NODE_PORTS
        members.add((nodeports[proto].key, str(port.node_port)))
        for address in node_addresses:
            serve(address, port.node_port, external)
            if not plan.has_external:
                members.add((verdict, entry(address, port.node_port)))
    if port.health_check_node_port:
        members.add((names.HEALTH_CHECK_NODE_PORT.key, str(port.health_check_node_port)))

    members.update((names.LOOP_BACK.key, f"{e.ip},{lower}:{e.port},{e.ip}") for e in plan.reachable)
    members.update(
        (names.IPVS_IPS.key, address)
        for address in (plan.cluster_ip, *plan.external_ips, *plan.load_balancer_ips)
    )
    return PortState(tuple(servers), frozenset(members))


@dataclass(frozen=True)
class Delta:
    """What a change of ports adds to and removes from the kernel's sets, and the virtual
    servers it changes."""

    added_members: set[Member]
    removed_members: set[Member]
    servers: dict[Frontend, VirtualServer | None]
    """The frontends whose wanted virtual server changed, with the one wanted before."""


NO_STATE = PortState()


class Desired:
    """The state of every port of one family, with owner counts."""

    def __init__(self) -> None:
        self.ports: dict[ServicePortName, PortState] = {}
        self.members: Counter[Member] = Counter()
        self._claims: dict[Frontend, dict[ServicePortName, VirtualServer]] = {}

    def update(self, states: Mapping[ServicePortName, PortState | None]) -> Delta:
        """Replace the ports' states (None: the port is gone); the delta is the net change
        of them all."""
        had: dict[Member, bool] = {}
        before: dict[Frontend, VirtualServer | None] = {}
        for name, state in states.items():
            old = self.ports.pop(name, NO_STATE)
            new = state or NO_STATE
            if state is not None:
                self.ports[name] = state
            for member in old.members ^ new.members:
                had.setdefault(member, member in self.members)
            for server in (*old.virtual_servers, *new.virtual_servers):
                before.setdefault(server.frontend, self.server(server.frontend))
            for member in old.members - new.members:
                self.members[member] -= 1
                if not self.members[member]:
                    del self.members[member]
            for member in new.members - old.members:
                self.members[member] += 1
            for server in old.virtual_servers:
                claims = self._claims[server.frontend]
                del claims[name]
                if not claims:
                    del self._claims[server.frontend]
            for server in new.virtual_servers:
                self._claims.setdefault(server.frontend, {})[name] = server
        return Delta(
            added_members={m for m, present in had.items() if not present and m in self.members},
            removed_members={m for m, present in had.items() if present and m not in self.members},
            servers={f: vs for f, vs in before.items() if self.server(f) != vs},
        )

    def server(self, frontend: Frontend) -> VirtualServer | None:
        """The wanted virtual server; when two ports claim one frontend, the first name's."""
        claims = self._claims.get(frontend)
        return claims[min(claims)] if claims else None

    def frontends(self) -> set[Frontend]:
        return set(self._claims)

    def entries(self, key: str) -> list[str]:
        return sorted(entry for (k, entry) in self.members if k == key)
