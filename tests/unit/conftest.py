"""The conntrack reconciler's clean-up of never-answered TCP and SCTP entries, recorded instead
of asked of the kernel."""

from __future__ import annotations

import pytest

from proxyd import conntrack
from proxyd.conntrack import Frontends


@pytest.fixture
def unanswered_cleared(monkeypatch: pytest.MonkeyPatch) -> list[dict[int, Frontends]]:
    """The frontends, by protocol number, of each clean-up the reconciler ran."""
    asked: list[dict[int, Frontends]] = []

    def record(frontends: dict[int, Frontends]) -> int:
        asked.append(frontends)
        return 0

    monkeypatch.setattr(conntrack, "clear_unanswered", record)
    return asked
