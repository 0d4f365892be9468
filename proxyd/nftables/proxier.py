"""The nftables proxier: one table per family, written by one nft transaction per sync that
holds only what the changed service ports own or use (or everything, on a full sync)."""

from __future__ import annotations

from proxyd.metrics import Metrics
from proxyd.model import ServicePortName
from proxyd.nftables.kernel import Nft, NftError
from proxyd.nftables.render import PortContext, Renderer, render_base
from proxyd.nftables.transaction import TableState, full_transaction, partial_transaction
from proxyd.plan import FamilyContext
from proxyd.proxier import Plans, ProgramError, Proxier, ProxyOptions


class NftablesProxier(Proxier):
    mode = "nftables"

    def __init__(self, options: ProxyOptions, families: tuple[int, ...], metrics: Metrics) -> None:
        super().__init__(options, families, metrics)
        self.kernel = {family: Nft(family) for family in families}
        self._written: dict[int, TableState | None] = dict.fromkeys(families)
        self._renderers = {family: Renderer() for family in families}

    def _program(
        self, ctx: FamilyContext, plans: Plans, changed: set[ServicePortName], full: bool
    ) -> bool:
        family = ctx.family
        kernel = self.kernel[family]
        base = render_base(ctx)
        renderer = self._renderers[family]
        old = self._written[family]
        full = full or old is None or old.base != base
        try:
            if full:
                new = TableState(base, renderer.render_all(plans, PortContext.of(ctx)))
                text = full_transaction(family, new, kernel.chains(), kernel.sets())
            else:
                assert old is not None
                new = old
                updates = renderer.render_changed(plans, changed)
                text = partial_transaction(family, new, updates)
            kernel.run(text)
        except NftError as err:
            self._written[family] = None
            raise ProgramError(str(err)) from err
        self._written[family] = new
        return full

    def _count_failure(self, full: bool) -> None:
        self.metrics.nftables_sync_failures.inc()

    def cleanup(self) -> int:
        """Delete the tables; returns how many existed."""
        return sum(kernel.delete_table() for kernel in self.kernel.values())
