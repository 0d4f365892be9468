"""Unit tests leave the kernel alone: the proxy's clean-up of never-answered conntrack entries,
run after every sync that writes a frontend's first rules, is recorded instead."""

from __future__ import annotations

import pytest

from proxyd import conntrack
from proxyd.conntrack import Address


@pytest.fixture(autouse=True)
def unanswered_cleared(
    monkeypatch: pytest.MonkeyPatch,
) -> list[tuple[int, dict[int, set[Address]]]]:
    """(family, frontends by protocol number) of each clean-up a sync asked for."""
    asked: list[tuple[int, dict[int, set[Address]]]] = []

    def record(family: int, frontends: dict[int, set[Address]]) -> int:
        asked.append((family, frontends))
        return 0

    monkeypatch.setattr(conntrack, "clear_unanswered", record)
    return asked
