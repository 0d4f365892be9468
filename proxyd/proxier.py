"""What every datapath shares: which service ports changed, their plans per family, when a
sync must be full, Local-policy and health-check bookkeeping, and which frontends' conntrack
entries the reconciler cleans (conntrack_reconciler.py).

A datapath subclasses Proxier and implements `_program` (write one family's changes to the
kernel) and `cleanup`, and `_rehearse` where the kernel offers a dry run.

When the kernel refuses a family's full sync, the service ports whose rules it refuses are
found by dry runs (containment.refused) and left out, logged by name, and the others are
written: one Service cannot stop a node's proxy. A port left out stays out until its plan
changes.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from cni.kernel.addresses import LinkAddress, link_addresses
from proxyd import conntrack
from proxyd.addresses import nodeport_addresses
from proxyd.conntrack_reconciler import ConntrackReconciler
from proxyd.containment import Held, Unprogrammable, refused
from proxyd.metrics import FamilyMetrics, Metrics, family_label
from proxyd.model import Endpoint, NodeInfo, ServicePort, ServicePortName, family_of
from proxyd.port_plan import FamilyContext, PortPlan, plan_port
from proxyd.tracker import Changes, ServiceKey, ServiceView

log = logging.getLogger(__name__)

FULL_SYNC_PERIOD = 3600.0
Plans = dict[ServicePortName, PortPlan]


@dataclass(frozen=True)
class ProxyOptions:
    cluster_cidrs: tuple[str, ...] = ()
    masquerade_all: bool = False
    masquerade_bit: int = 14
    nodeport_address_cidrs: tuple[str, ...] = ()
    localhost_nodeports: bool = True
    drop_invalid: bool = True
    """Drop forwarded packets conntrack marks INVALID (off with --conntrack-tcp-be-liberal,
    as kube-proxy: a liberal conntrack lets such packets through on purpose)."""


@dataclass(frozen=True)
class SyncResult:
    full: bool
    health_checks: dict[int, tuple[str, str, int]]
    """healthCheckNodePort -> (namespace, name, local endpoints)."""


class ProgramError(RuntimeError):
    """The kernel refused a sync's changes; the next sync of that family is full."""

    def __init__(self, message: str, families: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.families = families
        """The families whose sync failed (the others were written)."""


class Proxier(ABC):
    mode = ""

    def __init__(self, options: ProxyOptions, families: tuple[int, ...], metrics: Metrics) -> None:
        self.options = options
        self.families = families
        self.metrics = metrics
        self._views: dict[ServiceKey, ServiceView] = {}
        self._plans: dict[int, Plans] = {family: {} for family in families}
        for family in families:
            metrics.for_family(family)  # every family's series exported from the start, at 0
        self._in_sync: dict[int, bool] = dict.fromkeys(families, False)
        self._health_check_ports: dict[ServicePortName, ServicePort] = {}
        self._placement: tuple[str, str, tuple[str, ...]] | None = None
        self._no_local_internal: dict[int, set[ServicePortName]] = {f: set() for f in families}
        self._no_local_external: dict[int, set[ServicePortName]] = {f: set() for f in families}
        self._last_full = 0.0
        self._on_links: dict[int, list[LinkAddress]] = {}
        self._refused: dict[int, Held[ServicePortName]] = {family: Held() for family in families}
        """Per family, the ports left out because the kernel refused their rules, each with
        the plan it refused."""
        self.reconciler = ConntrackReconciler(metrics)
        """Cleans the conntrack entries of the frontends a sync changed, on its own thread."""

    @abstractmethod
    def _program(
        self, ctx: FamilyContext, plans: Plans, changed: set[ServicePortName], full: bool
    ) -> bool:
        """Make the kernel match `plans` (every port of ctx's family); only `changed` ports
        differ from the last call unless `full`. Returns whether it wrote everything.
        Raises ProgramError when the kernel refused."""

    @abstractmethod
    def cleanup(self) -> int:
        """Remove everything this datapath installed; returns how many objects went."""

    def _rehearse(self, ctx: FamilyContext, plans: Plans) -> bool:
        """Whether the kernel takes a full sync of `plans`, by a dry run that changes
        nothing; a datapath without one takes everything (so nothing is left out)."""
        return True

    def _count_failure(self, metrics: FamilyMetrics, full: bool) -> None:
        """kube-proxy's failure counters of the iptables-restore based modes."""
        metrics.restore_failures.inc()
        if not full:
            metrics.partial_restore_failures.inc()

    def link_addresses(self, family: int) -> list[LinkAddress]:
        """The family's addresses on the node, dumped at most once per sync (an IPVS node holds
        every service address)."""
        if family not in self._on_links:
            self._on_links[family] = link_addresses(family)
        return self._on_links[family]

    def context(
        self, family: int, node: NodeInfo, service_cidrs: tuple[str, ...] = ()
    ) -> FamilyContext:
        cidr = next((c for c in self.options.cluster_cidrs if family_of(c) == family), "")
        selected = nodeport_addresses(
            self.options.nodeport_address_cidrs, family, node, lambda: self.link_addresses(family)
        )
        return FamilyContext(
            family=family,
            node=node,
            cluster_cidr=cidr,
            masquerade_all=self.options.masquerade_all,
            masquerade_mark=1 << self.options.masquerade_bit,
            nodeport_addresses=selected,
            localhost_nodeports=self.options.localhost_nodeports,
            drop_invalid=self.options.drop_invalid,
            service_cidrs=tuple(c for c in service_cidrs if family_of(c) == family),
        )

    def sync(self, changes: Changes) -> SyncResult:
        """Program the changes, recording each family's part in its metrics; raises
        ProgramError, naming the families that failed, when the kernel refused them."""
        self._on_links.clear()
        changed: set[ServicePortName] = set()
        fresh: dict[ServicePortName, tuple[ServicePort, ServiceView]] = {}
        for key, view in changes.services.items():
            old = self._views.pop(key, None)
            if old is not None:
                changed.update(port.name for port in old.ports)
            if view.ports:
                self._views[key] = view
            for port in view.ports:
                fresh[port.name] = (port, view)
        changed.update(fresh)
        for name in changed:
            self._health_check_ports.pop(name, None)
        for name, (port, _) in fresh.items():
            if port.health_check_node_port:
                self._health_check_ports[name] = port
        node = changes.node
        placement = (node.name, node.zone, node.addresses)
        full = placement != self._placement or time.monotonic() - self._last_full > FULL_SYNC_PERIOD
        self._placement = placement
        wrote_all = full
        failed: dict[int, ProgramError] = {}
        cleanup: dict[int, dict[str, conntrack.Frontends]] = {}
        for family in self.families:
            start = time.monotonic()
            metrics = self.metrics.for_family(family)
            ctx = self.context(family, node, changes.service_cidrs)
            family_full = full or not self._in_sync[family]
            plans = self._plans[family]
            if family_full:
                plans = self._plan_all(ctx)
                touched = set(plans) | set(self._plans[family])
            else:
                touched = changed
                for name in changed:
                    plans.pop(name, None)
                for name, (port, view) in fresh.items():
                    plan = plan_port(port, view.endpoints[port], ctx)
                    if plan is not None:
                        plans[name] = plan
            self._hold_refused(family, plans, touched)
            # Until written: a failed sync leaves these plans ahead of the kernel, and the
            # family's next sync is full, planned afresh.
            self._in_sync[family] = False
            try:
                wrote = self._program(ctx, plans, touched, family_full)
            except ProgramError as err:
                # The other families still get these changes: they are taken for good.
                self._count_failure(metrics, family_full)
                kept = self._contain(ctx, plans) if family_full else None
                if kept is None:
                    failed[family] = err
                    continue
                plans, wrote = kept, True
            wrote_all = wrote or wrote_all
            self._in_sync[family] = True
            self._plans[family] = plans
            self._track_no_local(family, plans, touched)
            cleanup[family] = self._frontends(
                family, plans.values() if family_full else [plans[n] for n in fresh if n in plans]
            )
            elapsed = time.monotonic() - start
            self._record_sync(metrics, family, wrote or family_full, elapsed, changes)
        # handed over once every family is written, so that the reconciler's thread never
        # runs beside a family's part of the sync
        self.reconciler.changed(cleanup)
        if failed:
            first = next(iter(failed.values()))
            raise ProgramError("; ".join(map(str, failed.values())), frozenset(failed)) from first
        if wrote_all:
            self._last_full = time.monotonic()
        return SyncResult(full=wrote_all, health_checks=self._health_checks(node.name))

    def _hold_refused(self, family: int, plans: Plans, names: set[ServicePortName]) -> None:
        """Leave out of `plans` the ports among `names` whose rules the kernel refused, while
        their plan is the one it refused (and their hold lasts: containment.Held); a port
        whose plan changed is tried again."""
        held = self._refused[family]
        for name in [name for name in held if name in names]:
            if held.keeps(name, plans.get(name)):
                del plans[name]
        self.metrics.refused_service_ports.labels(family_label(family)).set(len(held))

    def _contain(self, ctx: FamilyContext, plans: Plans) -> Plans | None:
        """After the kernel refused a full sync of `plans`: finds by dry runs the ports whose
        rules it refuses, and writes the others; returns the plans written, or None when the
        refusal is no port's (or this datapath has no dry run) or the rest is refused too."""
        family = ctx.family
        try:
            bad = refused(sorted(plans), lambda names: self._rehearse(ctx, _only(plans, names)))
            # every port refused alone is a refusal of what any port brings (a chunk, the
            # switch-over), not of one port's rules: the live rules stay, and are retried
            if not bad or len(bad) == len(plans):
                return None
            kept = {name: plan for name, plan in plans.items() if name not in bad}
            self._program(ctx, kept, set(plans), True)
        except (ProgramError, Unprogrammable) as err:
            log.error("IPv%d: the rules without any refused service port failed: %s", family, err)
            return None
        for name in bad:
            if self._refused[family].hold(name, plans[name]):
                log.error(
                    "IPv%d: the kernel refused the rules of Service port %s; it is not served "
                    "until it changes",
                    family,
                    name,
                )
        self.metrics.refused_service_ports.labels(family_label(family)).set(
            len(self._refused[family])
        )
        return kept

    def _record_sync(
        self, metrics: FamilyMetrics, family: int, full: bool, elapsed: float, changes: Changes
    ) -> None:
        metrics.sync_duration.observe(elapsed)
        (metrics.full_sync_duration if full else metrics.partial_sync_duration).observe(elapsed)
        now = time.time()
        metrics.last_sync.set(now)
        for trigger in changes.trigger_times.get(family, ()):
            metrics.network_programming.observe(max(0.0, now - trigger))
        metrics.no_local_internal.set(len(self._no_local_internal[family]))
        metrics.no_local_external.set(len(self._no_local_external[family]))

    def _plan_all(self, ctx: FamilyContext) -> Plans:
        plans: Plans = {}
        for view in self._views.values():
            for port in view.ports:
                plan = plan_port(port, view.endpoints[port], ctx)
                if plan is not None:
                    plans[port.name] = plan
        return plans

    def _endpoints(self, port: ServicePort) -> tuple[Endpoint, ...]:
        """Every endpoint of the port, of both families, whatever its conditions."""
        return self._views[(port.name.namespace, port.name.name)].endpoints[port]

    def _frontends(self, family: int, plans: Iterable[PortPlan]) -> dict[str, conntrack.Frontends]:
        """These ports' frontends by protocol, for the conntrack reconciler, each with the
        endpoints that may answer it: the serving ones, whatever the policies, topology or
        termination say."""
        by_protocol: dict[str, conntrack.Frontends] = {}
        for plan in plans:
            frontends = by_protocol.setdefault(plan.port.protocol, conntrack.Frontends(family))
            allowed = {(e.ip, e.port) for e in self._endpoints(plan.port) if e.serving}
            for ip in (plan.cluster_ip, *plan.external_ips, *plan.load_balancer_ips):
                frontends.by_address[(ip, plan.port.port)] = allowed
            if plan.port.node_port:
                frontends.by_node_port[plan.port.node_port] = allowed
        return by_protocol

    def _health_checks(self, node_name: str) -> dict[int, tuple[str, str, int]]:
        """healthCheckNodePort -> its service and the ready endpoints the service has on this
        node (summed over its ports, in the family with most): a terminating endpoint, even
        one still serving, does not keep a load balancer sending new traffic here."""
        services: dict[int, tuple[str, str]] = {}
        local: dict[int, Counter[int]] = {}
        for name, port in self._health_check_ports.items():
            node_port = port.health_check_node_port
            services[node_port] = (name.namespace, name.name)
            counts = local.setdefault(node_port, Counter())
            for endpoint in self._endpoints(port):
                family = family_of(endpoint.ip)
                programmed = name in self._plans.get(family, {})
                if programmed and endpoint.ready and endpoint.node_name == node_name:
                    counts[family] += 1
        return {
            node_port: (*services[node_port], max(local[node_port].values(), default=0))
            for node_port in services
        }

    def _track_no_local(self, family: int, plans: Plans, names: set[ServicePortName]) -> None:
        internal, external = self._no_local_internal[family], self._no_local_external[family]
        for name in names:
            internal.discard(name)
            external.discard(name)
            plan = plans.get(name)
            if plan is not None and plan.no_local_internal:
                internal.add(name)
            if plan is not None and plan.no_local_external:
                external.add(name)


def _only(plans: Plans, names: Iterable[ServicePortName]) -> Plans:
    return {name: plans[name] for name in names}
