"""Unit tests leave the kernel alone: the proxy's clean-up of never-answered TCP and SCTP
conntrack entries, asked for by every sync that changes such a port, is recorded instead."""

from __future__ import annotations

import pytest

from proxyd import conntrack
from proxyd.conntrack import Frontends


@pytest.fixture(autouse=True)
def unanswered_cleared(monkeypatch: pytest.MonkeyPatch) -> list[dict[int, Frontends]]:
    """The frontends, by protocol number, of each clean-up a sync asked for."""
    asked: list[dict[int, Frontends]] = []

    def record(frontends: dict[int, Frontends]) -> int:
        asked.append(frontends)
        return 0

    monkeypatch.setattr(conntrack, "clear_unanswered", record)
    return asked
