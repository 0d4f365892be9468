"""The lab's cgroup walk, over a folder tree standing in for a hierarchy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from deploy.lab import machine
from deploy.lab.machine import Cgroup


def test_a_cgroup_that_goes_while_its_processes_are_listed_is_passed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node = tmp_path / "lab" / "node3"
    for folder, pids in ((node, "11\n"), (node / "pod" / "container", "12\n")):
        folder.mkdir(parents=True)
        (folder / "cgroup.procs").write_text(pids)
    monkeypatch.setattr(machine, "hierarchies", lambda: [tmp_path])
    read_text = Path.read_text

    def read_then_remove(path: Path) -> str:
        # the container's cgroup goes once its process was read, as runc removes it
        text = read_text(path)
        if path.parent.name == "container":
            shutil.rmtree(path.parent)
        return text

    monkeypatch.setattr(Path, "read_text", read_then_remove)
    assert Cgroup("lab/node3").pids() == {11, 12}
