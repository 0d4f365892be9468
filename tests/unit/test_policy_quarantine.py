"""What nft refuses stays with the pod it belongs to: the refused pods found by halving, their
chains quarantined (dropping all), the rest of the node's table written, with nft replaced by
one that refuses what a given pod's rules say. The kernel's side, with a real refusal, is in
tests/integration/test_hostile_objects_kernel.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import pytest

from cni.kernel.nftables import NftError
from proxyd.containment import Held, Unprogrammable, refused
from proxyd.metrics import Metrics
from proxyd.nftables.kernel import Nft
from proxyd.policy import enforcer as enforcer_module
from proxyd.policy.compile import DROP, PodChain
from proxyd.policy.enforcer import PolicyEnforcer
from proxyd.policy.quarantine import QUARANTINED, signature

POISON = 'comment "ns/bad"'
"""What the fake nft refuses: the bad pod's chain, as its owner's comment names it."""


def pod(name: str, address: str) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": name, "labels": {"app": name}},
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "podIPs": [{"ip": address}]},
    }


DENY_ALL = {
    "metadata": {"namespace": "ns", "name": "deny"},
    "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
}


class FakeNft:
    """Refuses any transaction (or dry run) holding POISON, or everything when `refusing`;
    records the transactions it took."""

    def __init__(self) -> None:
        self.loaded: list[str] = []
        self.tried: list[str] = []
        """Every transaction and dry run asked for."""
        self.refusing = False

    def check(self, text: str) -> None:
        self.tried.append(text)
        if self.refusing or POISON in text:
            raise NftError("refused", text)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def run(nft: Nft, text: str) -> None:
            self.check(text)
            if text:
                self.loaded.append(text)

        monkeypatch.setattr(Nft, "run", run)
        monkeypatch.setattr(Nft, "rehearse", lambda nft, text: self.check(text))
        monkeypatch.setattr(Nft, "exists", lambda nft: bool(self.loaded))


def enforcer_with(pods: list[dict[str, Any]]) -> PolicyEnforcer:
    enforcer = PolicyEnforcer("n1", (4,), 3600.0, Metrics())
    state = enforcer.state
    state.replace_namespaces([{"metadata": {"name": "ns"}}])
    state.replace_pods(pods)
    state.replace_policies([DENY_ALL])
    state.replace_cluster_policies([])
    return enforcer


def sample(enforcer: PolicyEnforcer, name: str) -> float:
    value = enforcer.metrics.registry.get_sample_value(name, {"ip_family": "IPv4"})
    return value or 0.0


def test_halving_finds_each_refused_pod_and_asks_few_dry_runs() -> None:
    pods = [f"pod-{n:03}" for n in range(200)]
    bad = {"pod-007", "pod-150"}
    asked: list[Sequence[str]] = []

    def accepts(part: Sequence[str]) -> bool:
        asked.append(part)
        return not bad & set(part)

    assert refused(pods, accepts) == sorted(bad)
    assert len(asked) <= 2 + 2 * 2 * 8, "two searches down eight halvings"
    assert refused(pods, lambda part: True) == []


def test_pods_refused_only_together_are_all_refused() -> None:
    assert refused(["a", "b"], lambda part: len(part) < 2) == ["a", "b"]


def test_a_table_refused_without_any_pod_is_unprogrammable() -> None:
    with pytest.raises(Unprogrammable):
        refused(["a", "b"], lambda part: False)


def test_a_refused_pod_is_quarantined_and_the_others_keep_their_rules(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    nft = FakeNft()
    nft.install(monkeypatch)
    enforcer = enforcer_with([pod("good", "10.0.0.2"), pod("bad", "10.0.0.3")])
    with caplog.at_level(logging.ERROR):
        enforcer.sync()
    written = enforcer._written[4]
    assert written is not None, "the table was written"
    bad_chain, good_chain = written.ingress["10.0.0.3"], written.ingress["10.0.0.2"]
    assert written.chains[bad_chain] == PodChain((), DROP, bad_chain), "it drops all"
    assert written.chains[good_chain].otherwise == DROP and good_chain not in written.quarantined
    assert f'add chain ip knit-policy {bad_chain} {{ comment "{QUARANTINED}"; }}' in nft.loaded[-1]
    assert "ns/bad" in caplog.text and "quarantined" in caplog.text
    assert sample(enforcer, "knit_network_policy_quarantined_pods") == 1
    assert sample(enforcer, "knit_network_policy_sync_failures_total") == 0
    assert enforcer.failures[4] == 0

    loads = len(nft.loaded)
    enforcer.state.replace_pods(
        [pod("good", "10.0.0.2"), pod("bad", "10.0.0.3"), pod("new", "10.0.0.4")]
    )
    enforcer.sync()
    assert len(nft.loaded) == loads + 1, "a partial transaction, taken at once"
    assert "10.0.0.4" in nft.loaded[-1] and POISON not in nft.loaded[-1]
    assert enforcer._written[4] is not None and bad_chain in enforcer._written[4].quarantined

    enforcer.state.replace_pods([pod("good", "10.0.0.2"), pod("new", "10.0.0.4")])
    enforcer.sync()
    assert nft.loaded[-1].startswith("add table ip knit-policy\ndelete table"), (
        "the quarantine lifted, the table written whole"
    )
    assert QUARANTINED not in nft.loaded[-1]
    assert sample(enforcer, "knit_network_policy_quarantined_pods") == 0
    enforcer.stop()


def test_a_table_nft_keeps_refusing_is_retried_later_and_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nft = FakeNft()
    nft.install(monkeypatch)
    nft.refusing = True
    enforcer = enforcer_with([pod("good", "10.0.0.2")])
    delays: list[float] = []
    monkeypatch.setattr(enforcer.runner, "retry_after", delays.append)
    for _ in range(8):
        enforcer.sync()
        loads = len(nft.tried)
        enforcer.sync()
        assert len(nft.tried) == loads, "an event within the backoff tries nothing"
        enforcer._retry_at.clear()  # the backoff ran out
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60]
    assert sample(enforcer, "knit_network_policy_sync_failures_total") == 8
    assert enforcer._written[4] is None
    nft.refusing = False
    enforcer.sync()
    assert enforcer.failures[4] == 0 and enforcer._written[4] is not None
    assert sample(enforcer, "knit_network_policy_sync_last_timestamp_seconds") > 0
    enforcer.stop()


def test_policy_health_fails_once_syncs_failed_for_the_timeout_and_not_for_a_quarantine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nft = FakeNft()
    nft.install(monkeypatch)
    enforcer = enforcer_with([pod("good", "10.0.0.2"), pod("bad", "10.0.0.3")])
    monkeypatch.setattr(enforcer.runner, "retry_after", lambda delay: None)
    enforcer.sync()
    now = time.time()
    (health,) = enforcer.health(60, now).values()
    assert health.healthy and health.quarantined == 1 and health.last_updated is not None

    nft.refusing = True
    enforcer.sync()
    assert enforcer.health(60, now + 59)[4].healthy, "failing, not yet for the timeout"
    assert not enforcer.health(60, now + 61)[4].healthy
    nft.refusing = False
    enforcer._retry_at.clear()  # the backoff ran out
    enforcer.sync()
    assert enforcer.health(60, now + 61)[4].healthy
    enforcer.stop()


def test_a_hold_doubles_with_each_refusal_of_the_same_object() -> None:
    now = [0.0]
    held = Held[str](clock=lambda: now[0])
    assert held.hold("pod", "rules") and not held.hold("pod", "rules"), "held once"
    assert held.keeps("pod", "rules"), "unchanged: held"
    assert held.keeps("pod", "edited"), "changed within its first second: still held"
    now[0] = 1.0
    assert not held.keeps("pod", "edited") and "pod" not in held, "changed, hold over: tried"
    assert held.hold("pod", "edited")
    now[0] = 2.5
    assert held.keeps("pod", "edited again"), "refused again: held two seconds"
    now[0] = 3.0
    assert not held.keeps("pod", "edited again")
    held.hold("pod", "x")
    assert not held.keeps("pod", None) and len(held) == 0, "gone: forgotten"
    assert held.hold("pod", "x") and held.keeps("pod", "y"), "strikes forgotten: a first hold"


def test_an_already_quarantined_pod_refused_again_with_others_keeps_its_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A part refused whole can hold a pod quarantined already: its hold keeps the rules it
    was refused with, not its chain that drops all (which would lift it at every sync)."""
    nft = FakeNft()
    nft.install(monkeypatch)
    enforcer = enforcer_with([pod("good", "10.0.0.2"), pod("bad", "10.0.0.3")])
    enforcer.sync()
    written = enforcer._written[4]
    assert written is not None
    bad_chain = written.ingress["10.0.0.3"]
    compiled = signature(enforcer._compilers[4].compile(enforcer.state.take()[0], None), bad_chain)
    monkeypatch.setattr(enforcer_module, "refused", lambda pods, accepts: list(pods))
    enforcer._contain(4, written)
    assert enforcer._quarantine[4].keeps(bad_chain, compiled)
    loads = len(nft.loaded)
    enforcer.sync()
    assert len(nft.loaded) == loads, "nothing changed, nothing written: no lift"
    enforcer.stop()
