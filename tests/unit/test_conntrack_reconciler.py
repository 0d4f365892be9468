"""The conntrack reconciler: what the syncs hand it is merged until its thread runs, each
family cleaned apart, a failure kept to its family."""

from __future__ import annotations

import socket
import threading

import pytest

from proxyd import conntrack
from proxyd.conntrack import Frontends
from proxyd.conntrack_reconciler import ConntrackReconciler
from proxyd.metrics import Metrics

TCP = socket.IPPROTO_TCP
A, B = ("10.244.1.5", 8080), ("10.244.2.5", 8080)


def frontends(family: int, **by_address: set[tuple[str, int]]) -> Frontends:
    """Frontends on port 80 of the addresses 10.96.0.N, named as `ipN`."""
    return Frontends(
        family, by_address={(f"10.96.0.{k[2:]}", 80): allowed for k, allowed in by_address.items()}
    )


def sample(reconciler: ConntrackReconciler, name: str, family: int) -> float | None:
    labels = {"ip_family": f"IPv{family}"}
    return reconciler.metrics.registry.get_sample_value(name, labels)


def test_the_frontends_of_syncs_before_a_run_are_cleaned_together_with_their_latest_endpoints(
    unanswered_cleared: list[dict[int, Frontends]],
) -> None:
    reconciler = ConntrackReconciler(Metrics())
    reconciler.changed({4: {"TCP": frontends(4, ip10={A, B}, ip11={A})}})
    reconciler.changed({4: {"TCP": frontends(4, ip10={B})}})
    assert unanswered_cleared == [], "nothing is cleaned before the reconciler runs"
    reconciler.reconcile()
    [cleaned] = unanswered_cleared
    assert cleaned[TCP].by_address == {("10.96.0.10", 80): {B}, ("10.96.0.11", 80): {A}}
    reconciler.reconcile()
    assert len(unanswered_cleared) == 1, "a run without a change cleans nothing"
    count = "kubeproxy_conntrack_reconciler_sync_duration_seconds_count"
    assert sample(reconciler, count, 4) == 1


def test_node_port_frontends_are_told_the_nodes_addresses_only_when_there_are_some(
    unanswered_cleared: list[dict[int, Frontends]],
) -> None:
    asked: list[int] = []

    def addresses(family: int) -> set[str]:
        asked.append(family)
        return {"192.168.1.10"}

    reconciler = ConntrackReconciler(Metrics(), addresses)
    reconciler.changed({4: {"TCP": frontends(4, ip10={A})}})
    reconciler.reconcile()
    assert asked == []
    reconciler.changed({4: {"SCTP": Frontends(4, by_node_port={30080: {A}})}})
    reconciler.reconcile()
    assert asked == [4]
    cleaned = unanswered_cleared[-1][socket.IPPROTO_SCTP]
    assert cleaned.stale(("192.168.1.10", 30080), ("192.168.1.10", 30080)), "not DNATed"
    assert not cleaned.stale(("192.168.1.10", 30080), A)


def test_a_familys_failed_clean_up_leaves_the_other_cleaned_and_the_thread_running(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cleaned: list[int] = []

    def clear_stale(frontends: Frontends) -> int:
        if frontends.family == 4:
            raise ValueError("an answer that could not be read")
        cleaned.append(frontends.family)
        return 3

    monkeypatch.setattr(conntrack, "clear_stale", clear_stale)
    reconciler = ConntrackReconciler(Metrics())
    reconciler.changed({4: {"UDP": frontends(4, ip10={A})}})
    reconciler.changed({6: {"UDP": Frontends(6, by_address={("fd00::10", 53): set()})}})
    reconciler.reconcile()
    assert cleaned == [6]
    assert sample(reconciler, "kubeproxy_conntrack_reconciler_deleted_entries_total", 6) == 3
    assert "IPv4: the conntrack clean-up failed" in caplog.text


def test_a_change_is_cleaned_on_the_reconcilers_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    on: list[str] = []
    done = threading.Event()

    def clear_stale(frontends: Frontends) -> int:
        on.append(threading.current_thread().name)
        done.set()
        return 0

    monkeypatch.setattr(conntrack, "clear_stale", clear_stale)
    reconciler = ConntrackReconciler(Metrics())
    thread = reconciler.start()
    try:
        reconciler.changed({4: {"UDP": frontends(4, ip10={A})}})
        assert done.wait(10)
    finally:
        reconciler.stop()
        thread.join(10)
    assert on == ["conntrack"]
