"""Chaos under churn, short (deploy/lab/chaos.py): each fault once, on random nodes, while the
churn runs and steady clients count what they lose; then the audit. `make chaos` runs it long.
The report stays in build/chaos/MODE/chaos.json.

Its name puts it after the lab's other modules (pytest takes them in name order within each
proxy mode's lab), so what it leaves behind, restarted daemons and a rebooted node, bears on
none of them."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.lab import chaos, faults
from deploy.lab.lab import Lab

# the fixture's lab takes minutes to come up when this module runs alone
pytestmark = pytest.mark.timeout(3600)

# faults that leave the data path alone: a held connection must outlive each of them
DATA_PATH_KEPT = tuple(kind for kind in faults.FAULT_KINDS if kind != "node rebooted")


def test_faults_under_churn_lose_nothing_and_leak_nothing(lab: Lab, tmp_path: Path) -> None:
    outcome = chaos.run(lab, tmp_path / "chaos", seconds=60, max_replicas=10)
    chaos.save(outcome, chaos.RESULTS / lab.mode)
    if outcome.problems or outcome.growth():
        chaos.keep_logs(lab, chaos.RESULTS / lab.mode / "logs")
    assert outcome.problems == []
    assert outcome.growth() == []
    assert outcome.churn_changes > 20
    windows = outcome.kinds
    assert [kind for kind in faults.FAULT_KINDS if not windows[kind].injected] == []
    # the kernel keeps the rules while knit-proxyd is away: the goal is no failed request
    assert windows["knit-proxyd killed"].failed_requests == 0
    lost = {
        kind: f"{windows[kind].held_kept}/{windows[kind].held_connections}"
        for kind in DATA_PATH_KEPT
        if windows[kind].held_kept != windows[kind].held_connections
    }
    assert lost == {}, "held connections lost"
