"""The iptables proxier: keeps the rendered rules of every service, and on each sync writes
only the difference (or everything, on a full sync) with one iptables-restore per family."""

from __future__ import annotations

import ipaddress
import logging
import time
from dataclasses import dataclass

from proxyd import conntrack
from proxyd.addresses import local_addresses, nodeport_addresses
from proxyd.iptables.chains import owned_by_knit
from proxyd.iptables.kernel import Iptables, RestoreError
from proxyd.iptables.render import (
    TABLES,
    RenderContext,
    ServiceRules,
    hook_target,
    render_base,
    render_service,
)
from proxyd.iptables.restore import (
    RuleSet,
    Script,
    batched_full_scripts,
    full_script,
    partial_script,
)
from proxyd.metrics import Metrics
from proxyd.model import Endpoint, NodeInfo, ServicePort, ServicePortName
from proxyd.tracker import Changes, ServiceKey, ServiceView

log = logging.getLogger(__name__)

FULL_SYNC_PERIOD = 3600.0
NFT_CHAINS_PER_RESTORE = 1000
"""iptables-nft's restore slows with the square of the chains it creates at once (see
restore.batched_full_scripts); iptables-legacy replaces the whole table on every restore, so
there a full sync stays one transaction."""

Fresh = dict[ServicePortName, tuple[ServicePort, tuple[Endpoint, ...]]]
"""Changed service ports as they are now, with their endpoints."""


@dataclass(frozen=True)
class ProxyOptions:
    cluster_cidrs: tuple[str, ...] = ()
    masquerade_all: bool = False
    masquerade_bit: int = 14
    nodeport_addresses: tuple[str, ...] = ()
    localhost_nodeports: bool = True


@dataclass(frozen=True)
class SyncResult:
    full: bool
    health_checks: dict[int, tuple[str, str, int]]
    """healthCheckNodePort -> (namespace, name, local endpoints)."""


def _family_of(cidr: str) -> int:
    return ipaddress.ip_network(cidr, strict=False).version


def _rule_count(rules: ServiceRules, table: str) -> int:
    own = sum(len(r) for r in rules.chains.values()) if table == "nat" else 0
    return own + sum(len(r) for (tbl, _), r in rules.shared.items() if tbl == table)


class IptablesProxier:
    mode = "iptables"

    def __init__(
        self,
        options: ProxyOptions,
        families: tuple[int, ...],
        metrics: Metrics,
        flavour: str | None = None,
    ) -> None:
        self.options = options
        self.families = families
        self.metrics = metrics
        self.kernel = {family: Iptables(family, flavour) for family in families}
        self._views: dict[ServiceKey, ServiceView] = {}
        self._written: dict[int, RuleSet | None] = dict.fromkeys(families)
        self._counts: dict[int, dict[str, int]] = {f: dict.fromkeys(TABLES, 0) for f in families}
        self._health_check_ports: dict[ServicePortName, ServicePort] = {}
        self._placement: tuple[str, str, tuple[str, ...]] | None = None
        self._no_local_internal: set[tuple[int, ServicePortName]] = set()
        self._no_local_external: set[tuple[int, ServicePortName]] = set()
        self._last_full = 0.0

    def _context(self, family: int, node: NodeInfo) -> RenderContext:
        cidr = next((c for c in self.options.cluster_cidrs if _family_of(c) == family), "")
        selected = None
        if self.options.nodeport_addresses:
            selected = nodeport_addresses(self.options.nodeport_addresses, family, node)
        return RenderContext(
            family=family,
            node=node,
            cluster_cidr=cidr,
            masquerade_all=self.options.masquerade_all,
            masquerade_mark=1 << self.options.masquerade_bit,
            nodeport_addresses=selected,
            localhost_nodeports=self.options.localhost_nodeports,
        )

    def sync(self, changes: Changes) -> SyncResult:
        """Program the changes; raises RestoreError when the kernel refused them."""
        changed_names: set[ServicePortName] = set()
        fresh: Fresh = {}
        for key, view in changes.services.items():
            old = self._views.pop(key, None)
            if old is not None:
                changed_names.update(port.name for port in old.ports)
            if view.ports:
                self._views[key] = view
            for port in view.ports:
                fresh[port.name] = (port, view.endpoints[port])
        changed_names.update(fresh)
        for name in changed_names:
            self._health_check_ports.pop(name, None)
        for name, (port, _) in fresh.items():
            if port.health_check_node_port:
                self._health_check_ports[name] = port
        node = changes.node
        full = (
            (node.name, node.zone, node.addresses) != self._placement
            or any(self._written[f] is None for f in self.families)
            or time.monotonic() - self._last_full > FULL_SYNC_PERIOD
        )
        self._placement = (node.name, node.zone, node.addresses)
        for family in self.families:
            self._sync_family(family, node, full, changed_names, fresh)
        if full:
            self._last_full = time.monotonic()
        return SyncResult(full=full, health_checks=self._health_checks())

    def _sync_family(
        self,
        family: int,
        node: NodeInfo,
        full: bool,
        changed: set[ServicePortName],
        fresh: Fresh,
    ) -> None:
        ctx = self._context(family, node)
        base = render_base(ctx)
        old = self._written[family]
        if old is not None and old.base != base:
            full = True
        kernel = self.kernel[family]
        if full:
            new = RuleSet(base)
            for port, endpoints in self._all_ports():
                new.services[port.name] = render_service(port, endpoints, ctx)
            snapshots = {t: kernel.snapshot(t, owned_by_knit) for t in TABLES}
            existing = {t: snapshots[t].chains for t in TABLES}
            if kernel.flavour == "nft":
                scripts = batched_full_scripts(new, existing, NFT_CHAINS_PER_RESTORE)
            else:
                scripts = [full_script(new, existing)]
            for table, chain, rule in reversed(base.hooks):
                if (chain, hook_target(rule)) not in snapshots[table].jumps:
                    scripts[-1].insert(table, chain, rule)
            counts = {t: new.rule_count(t) for t in TABLES}
        else:
            assert old is not None
            new = RuleSet(base, dict(old.services))
            counts = dict(self._counts[family])
            for name in changed:
                before = new.services.pop(name, None)
                if before is not None:
                    for t in TABLES:
                        counts[t] -= _rule_count(before, t)
            for name, (port, endpoints) in fresh.items():
                rendered = render_service(port, endpoints, ctx)
                new.services[name] = rendered
                for t in TABLES:
                    counts[t] += _rule_count(rendered, t)
            scripts = [partial_script(old, new, changed)]
        self._apply(family, scripts, full)
        self._written[family] = new
        self._counts[family] = counts
        for table in TABLES:
            self.metrics.iptables_total.labels(table=table, ip_family=f"IPv{family}").set(
                counts[table]
            )
            self.metrics.iptables_last.labels(table=table, ip_family=f"IPv{family}").set(
                sum(len(script.rules[table]) for script in scripts)
            )
        if full:
            tracked = self._no_local_internal | self._no_local_external
            changed = {name for f, name in tracked if f == family} | set(new.services)
        self._track_no_local(family, new, changed)
        udp = self._all_ports() if full else list(fresh.values())
        self._clear_udp(family, new, [port for port, _ in udp if port.protocol == "UDP"])

    def _all_ports(self) -> list[tuple[ServicePort, tuple[Endpoint, ...]]]:
        return [(p, view.endpoints[p]) for view in self._views.values() for p in view.ports]

    def _apply(self, family: int, scripts: list[Script], full: bool) -> None:
        kernel = self.kernel[family]
        try:
            for script in scripts:
                if not script.empty():
                    kernel.restore(script.text())
        except RestoreError:
            self._written[family] = None
            self.metrics.restore_failures.inc()
            if not full:
                self.metrics.partial_restore_failures.inc()
            raise

    def _clear_udp(self, family: int, ruleset: RuleSet, ports: list[ServicePort]) -> None:
        frontends = conntrack.UdpFrontends(family)
        for port in ports:
            rules = ruleset.services.get(port.name)
            allowed = {(e.ip, e.port) for e in rules.reachable} if rules else set()
            for ip in (*port.cluster_ips, *port.external_ips, *port.load_balancer_ips):
                if ipaddress.ip_address(ip).version == family:
                    frontends.by_address[(ip, port.port)] = allowed
            if port.node_port:
                frontends.by_node_port[port.node_port] = allowed
        if frontends:
            frontends.local_addresses = set(local_addresses(family))
            deleted = conntrack.clear_stale(frontends)
            if deleted:
                log.info("deleted %d stale UDP conntrack entries (IPv%d)", deleted, family)

    def _health_checks(self) -> dict[int, tuple[str, str, int]]:
        wanted: dict[int, tuple[str, str, int]] = {}
        for name, port in self._health_check_ports.items():
            local = 0
            for ruleset in self._written.values():
                rules = ruleset.services.get(name) if ruleset is not None else None
                local = max(local, rules.local_endpoints if rules else 0)
            wanted[port.health_check_node_port] = (name.namespace, name.name, local)
        return wanted

    def _track_no_local(self, family: int, ruleset: RuleSet, names: set[ServicePortName]) -> None:
        for name in names:
            key = (family, name)
            self._no_local_internal.discard(key)
            self._no_local_external.discard(key)
            rules = ruleset.services.get(name)
            if rules is not None and rules.no_local_internal:
                self._no_local_internal.add(key)
            if rules is not None and rules.no_local_external:
                self._no_local_external.add(key)

    def no_local_endpoints(self) -> tuple[int, int]:
        """(internal, external) counts of Local-policy service ports without local endpoints."""
        return len(self._no_local_internal), len(self._no_local_external)

    def cleanup(self) -> int:
        """Remove everything this proxy installed; returns the number of chains removed."""
        return sum(kernel.remove_owned(owned_by_knit) for kernel in self.kernel.values())
