"""What every datapath's sync shares, around a datapath that records its calls (pure)."""

from __future__ import annotations

import gc

from proxyd.metrics import Metrics
from proxyd.model import NodeInfo, ServicePortName
from proxyd.plan import FamilyContext
from proxyd.proxier import Plans, Proxier, ProxyOptions
from proxyd.tracker import Changes


class Recording(Proxier):
    mode = "recording"

    def __init__(self) -> None:
        super().__init__(ProxyOptions(), (4,), Metrics())
        self.collector_enabled: list[bool] = []

    def _program(
        self, ctx: FamilyContext, plans: Plans, changed: set[ServicePortName], full: bool
    ) -> bool:
        self.collector_enabled.append(gc.isenabled())
        return full

    def cleanup(self) -> int:
        return 0


def test_a_sync_holds_the_garbage_collector_off_and_restores_it() -> None:
    proxier = Recording()
    changes = Changes(services={}, node=NodeInfo("node-a"))
    assert gc.isenabled()
    assert proxier.sync(changes).full, "the first sync is full"
    assert gc.isenabled()
    gc.disable()
    try:
        proxier.sync(changes)
        assert not gc.isenabled(), "a collector turned off stays off"
    finally:
        gc.enable()
    assert proxier.collector_enabled == [False, False]
