"""The nftables proxier: one table per family, written by one nft transaction per sync that
holds only what the changed service ports own or use (or everything, on a full sync, made a
chunk of ports at a time while nft parses the chunks before; when the table has no chains yet,
a transaction per chunk, committed while the next is made)."""

from __future__ import annotations

from collections.abc import Iterator

from proxyd.metrics import Metrics
from proxyd.model import ServicePortName
from proxyd.nftables.kernel import Nft, NftError
from proxyd.nftables.render import PortContext, Renderer, render_base
from proxyd.nftables.transaction import (
    TableState,
    fresh_transactions,
    full_transaction,
    partial_transaction,
)
from proxyd.plan import FamilyContext
from proxyd.proxier import Plans, ProgramError, Proxier, ProxyOptions

FIRST_CHUNK = 100
LARGEST_CHUNK = 1000
"""Service ports per piece of a full sync (per transaction, into a table without chains): the
first chunk is small, as the Python making it is the one part nft does not overlap, and they
double up to 1,000 (at 10 endpoints a port costs nft ~0.1 ms and Python ~0.03 ms)."""


def chunks(names: list[ServicePortName]) -> Iterator[list[ServicePortName]]:
    start, size = 0, FIRST_CHUNK
    while start < len(names):
        yield names[start : start + size]
        start, size = start + size, min(2 * size, LARGEST_CHUNK)


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
        base = render_base(ctx)
        old = self._written[family]
        full = full or old is None or old.base != base
        try:
            if full:
                new = TableState(base)
                self._write_all(family, new, plans, PortContext.of(ctx))
            else:
                assert old is not None
                new = old
                updates = self._renderers[family].render_changed(plans, changed)
                self.kernel[family].run(partial_transaction(family, new, updates))
        except NftError as err:
            self._written[family] = None
            raise ProgramError(str(err)) from err
        self._written[family] = new
        return full

    def _write_all(self, family: int, state: TableState, plans: Plans, ctx: PortContext) -> None:
        """A full sync: its ports rendered a chunk at a time, in name order, while nft parses
        the chunks before, in one transaction over the table as it is or, when it has no
        chains (no packet goes through it), in a transaction per chunk."""
        kernel = self.kernel[family]
        renderer = self._renderers[family]
        renderer.begin_full(plans, ctx)
        existing_chains = kernel.chains()
        rendered = (renderer.render(plans, chunk) for chunk in chunks(sorted(plans)))
        if existing_chains:
            sets = kernel.sets()
            kernel.run_streamed(full_transaction(family, state, rendered, existing_chains, sets))
            return
        exists = existing_chains is not None
        kernel.run_each(fresh_transactions(family, state, rendered, replace=exists))

    def _count_failure(self, full: bool) -> None:
        self.metrics.nftables_sync_failures.inc()

    def cleanup(self) -> int:
        """Delete the tables; returns how many existed."""
        return sum(kernel.delete_table() for kernel in self.kernel.values())
