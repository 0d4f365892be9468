"""The nftables proxier: one table per family, written by one nft transaction per partial sync
that holds only what the changed service ports own or use; a full sync fills the maps of the
generation the rules do not name, a transaction per chunk of ports committed while the next is
made, then switches the rules over in one more."""

from __future__ import annotations

from collections.abc import Iterator

from cni.kernel.nftables import NftError
from proxyd.metrics import FamilyMetrics, Metrics
from proxyd.model import ServicePortName
from proxyd.nftables.kernel import Nft
from proxyd.nftables.render import SERVICES, BaseObjects, PortContext, Renderer, render_base
from proxyd.nftables.transaction import (
    KernelTable,
    TableState,
    full_transactions,
    live_generation,
    partial_transaction,
)
from proxyd.port_plan import FamilyContext
from proxyd.proxier import Plans, ProgramError, Proxier, ProxyOptions

FIRST_CHUNK = 100
LARGEST_CHUNK = 1000
"""Service ports per transaction of a full sync: the first chunk is small, as the Python making
it is the one part nft does not overlap, and they double up to 1,000 (a port costs Python less
than nft, so later chunks' Python keeps ahead of nft's loads:
docs/benchmarks.md#nftables-mode-the-full-syncs-python-and-nfts-own-time; nft holds one
chunk's transaction in memory at a time)."""


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
                new = self._write_all(family, base, plans, PortContext.of(ctx))
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

    def _write_all(
        self, family: int, base: BaseObjects, plans: Plans, ctx: PortContext
    ) -> TableState:
        """A full sync: its ports rendered a chunk at a time, in name order, into the
        generation the table's rules do not name, then the rules switched over to it."""
        state, transactions = self._full(family, base, plans, ctx, self._renderers[family])
        self.kernel[family].run_each(transactions)
        return state

    def _full(
        self, family: int, base: BaseObjects, plans: Plans, ctx: PortContext, renderer: Renderer
    ) -> tuple[TableState, Iterator[str]]:
        """A full sync's state and its transactions, made as they are taken."""
        kernel = self.kernel[family]
        renderer.begin_full(plans, ctx)
        chains, sets = kernel.chains() or set(), kernel.sets()
        live = live_generation(
            base, sets, lambda: kernel.chain(SERVICES) if SERVICES in chains else None
        )
        state = TableState(base, generation=1 if live == 0 else 0)
        rendered = (renderer.render(plans, chunk) for chunk in chunks(sorted(plans)))
        return state, full_transactions(family, state, rendered, KernelTable(chains, sets))

    def _rehearse(self, ctx: FamilyContext, plans: Plans) -> bool:
        # a renderer of its own: the proxier's keeps what it last wrote
        _, transactions = self._full(
            ctx.family, render_base(ctx), plans, PortContext.of(ctx), Renderer()
        )
        try:
            self.kernel[ctx.family].rehearse("\n".join(transactions))
        except NftError:
            return False
        return True

    def _count_failure(self, metrics: FamilyMetrics, full: bool) -> None:
        metrics.nftables_sync_failures.inc()

    def cleanup(self) -> int:
        """Delete the tables; returns how many existed."""
        return sum(kernel.delete_table() for kernel in self.kernel.values())
