"""The iptables proxier: keeps the rendered rules of every service, and on each sync writes
only the difference (or everything, on a full sync) with one iptables-restore per family."""

from __future__ import annotations

from cni.kernel.errors import FirewallError
from proxyd.iptables.chains import owned_by_knit
from proxyd.iptables.kernel import IptablesKernel
from proxyd.iptables.render import TABLES, ServiceRules, render_base, render_service
from proxyd.iptables.restore import RuleSet, full_script, partial_script
from proxyd.metrics import Metrics, family_label
from proxyd.model import ServicePortName
from proxyd.port_plan import FamilyContext
from proxyd.proxier import Plans, ProgramError, Proxier, ProxyOptions

NFT_CHAINS_PER_RESTORE = 1000
"""iptables-nft's restore slows with the square of the chains it creates at once (see
restore.batched_full_scripts); iptables-legacy replaces the whole table on every restore, so
there a full sync stays one transaction."""


def _rule_count(rules: ServiceRules, table: str) -> int:
    own = sum(len(r) for r in rules.chains.values()) if table == "nat" else 0
    return own + sum(len(r) for (tbl, _), r in rules.shared.items() if tbl == table)


class IptablesProxier(Proxier):
    mode = "iptables"

    def __init__(
        self,
        options: ProxyOptions,
        families: tuple[int, ...],
        metrics: Metrics,
        flavour: str | None = None,
    ) -> None:
        super().__init__(options, families, metrics)
        self.kernel = {family: IptablesKernel(family, flavour) for family in families}
        self._written: dict[int, RuleSet | None] = dict.fromkeys(families)
        self._counts: dict[int, dict[str, int]] = {f: dict.fromkeys(TABLES, 0) for f in families}

    def _program(
        self, ctx: FamilyContext, plans: Plans, changed: set[ServicePortName], full: bool
    ) -> bool:
        family = ctx.family
        base = render_base(ctx)
        old = self._written[family]
        full = full or old is None or old.base != base
        kernel = self.kernel[family]
        try:
            if full:
                new = RuleSet(base)
                for name, plan in plans.items():
                    new.services[name] = render_service(plan, ctx)
                counts = {t: new.rule_count(t) for t in TABLES}
                batch = NFT_CHAINS_PER_RESTORE if kernel.flavour == "nft" else None
                scripts = kernel.write_full(new, owned_by_knit, batch)
            else:
                assert old is not None
                new = RuleSet(base, dict(old.services))
                counts = dict(self._counts[family])
                for name in changed:
                    before = new.services.pop(name, None)
                    if before is not None:
                        for t in TABLES:
                            counts[t] -= _rule_count(before, t)
                    wanted = plans.get(name)
                    if wanted is not None:
                        rendered = render_service(wanted, ctx)
                        new.services[name] = rendered
                        for t in TABLES:
                            counts[t] += _rule_count(rendered, t)
                scripts = [partial_script(old, new, changed)]
                kernel.write(scripts)
        except FirewallError as err:
            raise ProgramError(str(err)) from err
        self._written[family] = new
        self._counts[family] = counts
        for table in TABLES:
            self.metrics.iptables_total.labels(table=table, ip_family=family_label(family)).set(
                counts[table]
            )
            self.metrics.iptables_last.labels(table=table, ip_family=family_label(family)).set(
                sum(len(script.rules[table]) for script in scripts)
            )
        return full

    def _rehearse(self, ctx: FamilyContext, plans: Plans) -> bool:
        rendered = {name: render_service(plan, ctx) for name, plan in plans.items()}
        try:
            self.kernel[ctx.family].restore(
                full_script(RuleSet(render_base(ctx), rendered), {}).text(), test=True
            )
        except FirewallError:
            return False
        return True

    def cleanup(self) -> int:
        """Remove everything this proxy installed; returns the number of chains removed."""
        return sum(kernel.remove_owned(owned_by_knit) for kernel in self.kernel.values())
