"""The IPVS proxier: per family, virtual servers through netlink, the addresses of the dummy
link, ipset members and a fixed set of iptables rules, all written as differences.

A full sync (start-up, after a failure, when the node's addresses or NodePort addresses
change, hourly) reads the kernel's virtual servers and the dummy link's addresses, refills
every set atomically and rewrites the rules; a partial sync touches only the changed ports'
changed virtual servers, members and addresses. Every sync also deletes the gracefully
removed real servers whose connections ended (see servers.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import replace

from pyroute2.ipset import IPSetError
from pyroute2.netlink.exceptions import NetlinkError

from cni.kernel.addresses import link_addresses
from cni.kernel.errors import FirewallError
from proxyd.iptables.kernel import IptablesKernel
from proxyd.iptables.render import TABLES
from proxyd.iptables.restore import RuleSet
from proxyd.ipvs import dummy, names
from proxyd.ipvs.desired import Desired, Frontend, dummy_addresses, nodeport_addresses, port_state
from proxyd.ipvs.ipsets import Ipsets, destroy_owned
from proxyd.ipvs.netlink import IpvsKernel, IpvsUnavailable, ipvs_loaded, open_socket
from proxyd.ipvs.rules import render
from proxyd.ipvs.servers import ServerSync
from proxyd.metrics import Metrics, family_label
from proxyd.model import ServicePortName
from proxyd.port_plan import FamilyContext
from proxyd.proxier import Plans, ProgramError, Proxier, ProxyOptions

KERNEL_ERRORS = (NetlinkError, IPSetError, FirewallError, OSError)
NODE_PORT_SETS = tuple(
    (protocol, (names.NODE_PORTS[protocol].key, names.NODE_PORTS_LOCAL[protocol].key))
    for protocol in names.PROTOCOLS
)


def _owned_frontends(
    services: Iterable[Frontend], bound: frozenset[str], sets: Ipsets
) -> set[Frontend]:
    """knit's virtual servers among `services`: those on the dummy link's addresses (`bound`),
    and those on a node address whose port is in a NodePort set."""
    ports = sets.ports(key for _, keys in NODE_PORT_SETS for key in keys)
    nodeports = {
        (protocol, port) for protocol, keys in NODE_PORT_SETS for key in keys for port in ports[key]
    }
    return {
        frontend
        for frontend in services
        if frontend.address in bound or (frontend.protocol, frontend.port) in nodeports
    }


class IpvsProxier(Proxier):
    mode = "ipvs"

    def __init__(
        self,
        options: ProxyOptions,
        families: tuple[int, ...],
        metrics: Metrics,
        scheduler: str = "rr",
    ) -> None:
        # IPVS serves no NodePort on loopback, so route_localnet stays off (it would need the
        # other modes' drop of martian localnet traffic, CVE-2020-8558) and the NodePort
        # rules leave 127.0.0.0/8 out.
        super().__init__(replace(options, localhost_nodeports=False), families, metrics)
        self.scheduler = scheduler
        self.iptables = {family: IptablesKernel(family) for family in families}
        self.ipsets = {family: Ipsets(family) for family in families}
        self._ipvs: IpvsKernel | None = None
        self._servers: dict[int, ServerSync] = {}
        self._desired: dict[int, Desired | None] = dict.fromkeys(families)
        self._nodeports: dict[int, tuple[str, ...]] = {}

    def _kernel(self) -> IpvsKernel:
        if self._ipvs is None:
            try:
                self._ipvs = IpvsKernel(open_socket())
            except IpvsUnavailable as err:
                raise ProgramError(str(err)) from err
            self._servers = {f: ServerSync(self._ipvs, f) for f in self.families}
        return self._ipvs

    def _program(
        self, ctx: FamilyContext, plans: Plans, changed: set[ServicePortName], full: bool
    ) -> bool:
        family = ctx.family
        desired = self._desired[family]
        self._desired[family] = None
        try:
            self._kernel()
            on_node = dummy.node_addresses(self.link_addresses(family))
            nodeports = nodeport_addresses(ctx, on_node.elsewhere)
            if full or desired is None or nodeports != self._nodeports.get(family):
                desired, full = self._full(ctx, plans, nodeports, on_node.bound), True
            else:
                self._partial(ctx, desired, plans, changed, nodeports)
        except KERNEL_ERRORS as err:
            raise ProgramError(f"IPv{family} IPVS sync failed: {err}") from err
        self._desired[family] = desired
        self._nodeports[family] = nodeports
        return full

    def _full(
        self, ctx: FamilyContext, plans: Plans, nodeports: tuple[str, ...], bound: frozenset[str]
    ) -> Desired:
        """Everything written again; `bound`: the dummy's addresses as the sync began."""
        family = ctx.family
        dummy.ensure()
        sets = self.ipsets[family]
        sets.ensure()
        desired = Desired()
        desired.update(
            {name: port_state(plan, ctx, self.scheduler, nodeports) for name, plan in plans.items()}
        )
        wanted = dummy_addresses(desired.members)
        servers = self._servers[family]
        existing = servers.kernel.services(family)
        owned = _owned_frontends(existing, bound, sets)
        dummy.bind(wanted - bound, set())
        servers.apply(dict.fromkeys(desired.frontends() | owned), desired.server, existing)
        for spec in names.SETS:
            sets.replace(spec, desired.entries(spec.key))
        self._write_rules(ctx)
        dummy.bind(set(), bound - wanted)
        return desired

    def _partial(
        self,
        ctx: FamilyContext,
        desired: Desired,
        plans: Plans,
        changed: set[ServicePortName],
        nodeports: tuple[str, ...],
    ) -> None:
        family = ctx.family
        delta = desired.update(
            {
                name: None
                if (plan := plans.get(name)) is None
                else port_state(plan, ctx, self.scheduler, nodeports)
                for name in changed
            }
        )
        dummy.bind(dummy_addresses(delta.added_members), set())
        self._servers[family].apply(delta.servers, desired.server)
        self.ipsets[family].update(sorted(delta.added_members), sorted(delta.removed_members))
        dummy.bind(set(), dummy_addresses(delta.removed_members))

    def _write_rules(self, ctx: FamilyContext) -> None:
        family = ctx.family
        ruleset = RuleSet(render(ctx))
        self.iptables[family].write_full(ruleset, names.owned_chain)
        for table in TABLES:
            self.metrics.iptables_total.labels(table=table, ip_family=family_label(family)).set(
                ruleset.rule_count(table)
            )

    def cleanup(self) -> int:
        """Remove knit's IPVS virtual servers (on the dummy link's addresses, or on NodePorts
        its sets name), its chains, its sets and the dummy link; returns how many went. The
        other modes call it at start: without ip_vs loaded there is no virtual server to
        remove, and asking IPVS's netlink family would load the module."""
        removed = 0
        ipvs: IpvsKernel | None = None
        if ipvs_loaded():
            with contextlib.suppress(IpvsUnavailable):
                ipvs = IpvsKernel(open_socket())
        if ipvs is not None:
            for family in self.families:
                services = ipvs.services(family)
                owned = _owned_frontends(
                    services,
                    dummy.node_addresses(link_addresses(family)).bound,
                    self.ipsets[family],
                )
                for frontend in sorted(owned):
                    ipvs.delete_service(frontend)
                removed += len(owned)
            ipvs.sock.close()
        removed += sum(k.remove_owned(names.owned_chain) for k in self.iptables.values())
        removed += destroy_owned()
        removed += int(dummy.delete())
        return removed
