"""What the daemon sets up on its node before syncing: kernel modules (unit level: a fake
modprobe on PATH, since this kernel has br_netfilter built in and the daemon never needs
to load it here); when its first sync comes; and how it retries a sync the kernel refused."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from proxyd.config import load
from proxyd.daemon import Daemon, _load_br_netfilter
from proxyd.proxier import ProgramError
from proxyd.runner import BoundedFrequencyRunner


def fake_modprobe(directory: Path, exit_code: int) -> Path:
    calls = directory / "calls"
    script = directory / "modprobe"
    script.write_text(
        f'#!/bin/sh\necho "$@" >> {calls}\necho "modprobe: FATAL: not found" >&2\n'
        f"exit {exit_code}\n"
    )
    script.chmod(0o755)
    return calls


def test_br_netfilter_is_loaded_with_modprobe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = fake_modprobe(tmp_path, 0)
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        _load_br_netfilter()
    assert calls.read_text().split() == ["br_netfilter"]
    assert caplog.text == ""


@pytest.mark.parametrize("installed", [True, False])
def test_a_failed_load_is_a_warning_naming_what_breaks(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    installed: bool,
) -> None:
    if installed:
        fake_modprobe(tmp_path, 1)
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level(logging.WARNING):
        _load_br_netfilter()
    assert "cannot load br_netfilter" in caplog.text
    assert "own node gets no answer" in caplog.text
    if installed:
        assert "FATAL: not found" in caplog.text


def test_a_failed_sync_waits_out_its_backoff_whatever_events_come(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Events arriving while a failed sync backs off queue their changes; they do not make the
    proxy try the whole table again at once."""
    daemon = Daemon(load(["--hostname-override", "n1", "--proxy-mode", "nftables"]))
    tried: list[int] = []

    def refused(changes: object) -> None:
        tried.append(1)
        raise ProgramError("refused", frozenset({4}))

    delays: list[float] = []
    monkeypatch.setattr(daemon.proxier, "sync", refused)
    monkeypatch.setattr(daemon.state, "ready", lambda: True)
    monkeypatch.setattr(daemon.runner, "retry_after", delays.append)
    daemon.sync()
    daemon.sync()
    assert len(tried) == 1 and delays == [1.0]
    daemon._retry_at = 0.0  # the backoff ran out
    daemon.sync()
    assert len(tried) == 2 and delays == [1.0, 2.0]


def test_the_first_sync_follows_the_first_lists_at_once() -> None:
    """What the daemon hears before the first lists of Services, EndpointSlices and Nodes (the
    policy's first sync, a list of ServiceCIDRs) asks for no sync: each would have spent a
    token of the runner's burst on a sync with nothing to do, and the first real one would wait
    out the minimum interval. Nor do the Services and slices alone: the node's addresses, where
    NodePorts listen, come with its Node."""
    daemon = Daemon(load(["--hostname-override", "n1", "--proxy-mode", "nftables"]))
    ready_at_runs: list[bool] = []
    daemon.runner = BoundedFrequencyRunner(
        lambda: ready_at_runs.append(daemon.state.ready()), 60.0, 600.0, clock=lambda: 0.0
    )
    daemon.policy.on_first_sync()
    daemon.runner.poll()
    daemon.state.replace_service_cidrs([])
    daemon.runner.poll()
    daemon.state.replace_services([])
    daemon.runner.poll()
    daemon.state.replace_slices([])
    daemon.runner.poll()
    daemon.state.replace_node({"metadata": {"name": "n1"}})
    assert daemon.runner.poll()
    assert ready_at_runs == [True]
