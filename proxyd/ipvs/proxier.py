"""The IPVS proxier: per family, virtual servers through netlink, the addresses of the dummy
link, ipset members and a fixed set of iptables rules, all written as differences.

A full sync (start-up, after a failure, when the node's addresses or NodePort addresses
change, hourly) reads the kernel's virtual servers and the dummy link's addresses, refills
every set atomically and rewrites the rules; a partial sync touches only the changed ports'
virtual servers, members and addresses. Every sync also deletes the gracefully removed real
servers whose connections ended (see servers.py).
"""

from __future__ import annotations

from pyroute2.ipset import IPSetError
from pyroute2.netlink.exceptions import NetlinkError

from proxyd.iptables.kernel import Iptables, RestoreError
from proxyd.ipvs import dummy, names
from proxyd.ipvs.ipsets import Ipsets, destroy_owned
from proxyd.ipvs.netlink import IpvsKernel, IpvsUnavailable, enable_sysctls, open_socket
from proxyd.ipvs.plan import Delta, Desired, Frontend, nodeport_addresses, port_state
from proxyd.ipvs.rules import TABLES, Rules, render, script
from proxyd.ipvs.servers import ServerSync
from proxyd.metrics import Metrics
from proxyd.model import ServicePortName
from proxyd.plan import FamilyContext
from proxyd.proxier import Plans, ProgramError, Proxier, ProxyOptions

KERNEL_ERRORS = (NetlinkError, IPSetError, RestoreError, OSError)


class IpvsProxier(Proxier):
    mode = "ipvs"

    def __init__(
        self,
        options: ProxyOptions,
        families: tuple[int, ...],
        metrics: Metrics,
        scheduler: str = "rr",
    ) -> None:
        super().__init__(options, families, metrics)
        self.scheduler = scheduler
        self.iptables = {family: Iptables(family) for family in families}
        self.ipsets = {family: Ipsets(family) for family in families}
        self._ipvs: IpvsKernel | None = None
        self._servers: dict[int, ServerSync] = {}
        self._desired: dict[int, Desired | None] = dict.fromkeys(families)
        self._nodeports: dict[int, tuple[str, ...]] = {}
        self._rules: dict[int, Rules | None] = dict.fromkeys(families)

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
        self._kernel()
        family = ctx.family
        nodeports = nodeport_addresses(ctx, dummy.node_addresses(family))
        desired = self._desired[family]
        full = full or desired is None or nodeports != self._nodeports.get(family)
        self._desired[family] = None
        try:
            if full or desired is None:
                desired = self._full(ctx, plans, nodeports)
            else:
                self._partial(ctx, desired, plans, changed, nodeports)
        except KERNEL_ERRORS as err:
            self._rules[family] = None
            raise ProgramError(f"IPv{family} IPVS sync failed: {err}") from err
        self._desired[family] = desired
        self._nodeports[family] = nodeports
        return full

    def _full(self, ctx: FamilyContext, plans: Plans, nodeports: tuple[str, ...]) -> Desired:
        family = ctx.family
        enable_sysctls()
        dummy.ensure()
        sets = self.ipsets[family]
        sets.ensure()
        desired = Desired()
        for name, plan in plans.items():
            desired.set(name, port_state(plan, ctx, self.scheduler, nodeports))
        bound = dummy.addresses(family)
        servers = self._servers[family]
        owned = {
            frontend
            for frontend in servers.kernel.services(family)
            if frontend.address in bound or self._owned_nodeport(sets, frontend)
        }
        dummy.bind(set(desired.addresses) - bound, set())
        servers.apply(desired.frontends() | owned, desired.server, full=True)
        for spec in names.SETS:
            sets.replace(spec, desired.entries(spec.key))
        self._write_rules(ctx, force=True)
        dummy.bind(set(), bound - set(desired.addresses))
        return desired

    @staticmethod
    def _owned_nodeport(sets: Ipsets, frontend: Frontend) -> bool:
        """A virtual server on a node address is knit's when its port is in a NodePort set."""
        port = str(frontend.port)
        return sets.contains(names.NODE_PORTS[frontend.protocol].key, port) or sets.contains(
            names.NODE_PORTS_LOCAL[frontend.protocol].key, port
        )

    def _partial(
        self,
        ctx: FamilyContext,
        desired: Desired,
        plans: Plans,
        changed: set[ServicePortName],
        nodeports: tuple[str, ...],
    ) -> None:
        family = ctx.family
        total = Delta()
        for name in changed:
            plan = plans.get(name)
            state = None if plan is None else port_state(plan, ctx, self.scheduler, nodeports)
            delta = desired.set(name, state)
            total.added_members |= delta.added_members
            total.removed_members |= delta.removed_members
            total.added_addresses |= delta.added_addresses
            total.removed_addresses |= delta.removed_addresses
            total.frontends |= delta.frontends
        added = {a for a in total.added_addresses if desired.addresses[a]}
        dummy.bind(added, set())
        self._servers[family].apply(total.frontends, desired.server, full=False)
        self.ipsets[family].update(
            sorted(m for m in total.added_members if desired.members[m]),
            sorted(m for m in total.removed_members if not desired.members[m]),
        )
        self._write_rules(ctx, force=False)
        dummy.bind(set(), {a for a in total.removed_addresses if not desired.addresses[a]})

    def _write_rules(self, ctx: FamilyContext, force: bool) -> None:
        family = ctx.family
        rules = render(ctx)
        if not force and rules == self._rules[family]:
            return
        kernel = self.iptables[family]
        snapshots = {t: kernel.snapshot(t, names.owned_chain) for t in TABLES}
        kernel.restore(
            script(
                rules,
                {t: snapshots[t].chains for t in TABLES},
                {t: snapshots[t].jumps for t in TABLES},
            )
        )
        self._rules[family] = rules
        for table in TABLES:
            count = sum(len(r) for (tbl, _), r in rules.chains.items() if tbl == table)
            self.metrics.iptables_total.labels(table=table, ip_family=f"IPv{family}").set(count)

    def cleanup(self) -> int:
        """Remove knit's IPVS virtual servers (on the dummy link's addresses, or on NodePorts
        its sets name), its chains, its sets and the dummy link; returns how many went."""
        removed = 0
        try:
            ipvs: IpvsKernel | None = IpvsKernel(open_socket())
        except IpvsUnavailable:
            ipvs = None
        if ipvs is not None:
            for family in self.families:
                bound = dummy.addresses(family)
                for frontend in ipvs.services(family):
                    if frontend.address in bound or self._owned_nodeport(
                        self.ipsets[family], frontend
                    ):
                        ipvs.delete_service(frontend)
                        removed += 1
            ipvs.sock.close()
        removed += sum(k.remove_owned(names.owned_chain) for k in self.iptables.values())
        removed += destroy_owned()
        removed += int(dummy.delete())
        return removed
