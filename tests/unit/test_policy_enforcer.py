"""The policy enforcer's bookkeeping around its loads, with nft replaced (the tables it
writes, and the kernel taking them, are proven in tests/integration/test_network_policy.py
and test_nft_kernel.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from cni.kernel.nftables import NftError
from proxyd.metrics import Metrics
from proxyd.nftables.kernel import Nft
from proxyd.policy.admission import sandbox_pod
from proxyd.policy.enforcer import PolicyEnforcer


def pod(name: str, address: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": name, "uid": name, "labels": labels},
        "spec": {"nodeName": "n1"},
        "status": {"phase": "Running", "podIPs": [{"ip": address}]},
    }


def test_a_refused_load_has_its_family_written_whole_next_and_leaves_the_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loaded: list[tuple[int, str]] = []
    refusing = {6}

    def run(nft: Nft, text: str) -> None:
        if text:
            loaded.append((nft.family, text.splitlines()[0]))
        if nft.family in refusing:
            raise NftError("refused")

    def rehearse(nft: Nft, text: str) -> None:
        if nft.family in refusing:
            raise NftError("refused")

    monkeypatch.setattr(Nft, "run", run)
    monkeypatch.setattr(Nft, "rehearse", rehearse)
    monkeypatch.setattr(Nft, "exists", lambda nft: False)
    enforcer = PolicyEnforcer("n1", (4, 6), 3600.0, Metrics())
    state = enforcer.state
    state.replace_namespaces([{"metadata": {"name": "ns"}}])
    state.replace_pods([pod("a", "10.0.0.2", {"app": "a"}), pod("b", "fd00::2", {"app": "b"})])
    state.replace_policies([])
    state.replace_cluster_policies([])

    enforcer.sync()
    assert loaded == [
        (4, 'add table ip knit-policy { comment "knit NetworkPolicy"; }'),
        (6, 'add table ip6 knit-policy { comment "knit NetworkPolicy"; }'),
    ]
    refusing.clear()
    loaded.clear()
    enforcer._retry_at.clear()  # IPv6's backoff ran out
    enforcer.sync()
    assert loaded == [(6, 'add table ip6 knit-policy { comment "knit NetworkPolicy"; }')], (
        "IPv4's table was written and nothing changed; IPv6's is written whole again"
    )
    enforcer.stop()


def test_a_familys_nft_context_is_used_by_one_thread_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """A context is not for two threads at once: each family's rehearsal and loads run on one
    thread, even when IPv4's rehearsal is still running as the first sync loads."""
    used_by: dict[int, list[str]] = {4: [], 6: []}
    both_loaded = threading.Event()

    def rehearse(nft: Nft, text: str) -> None:
        if nft.family == 4:
            time.sleep(0.2)
        used_by[nft.family].append(threading.current_thread().name)

    def run(nft: Nft, text: str) -> None:
        used_by[nft.family].append(threading.current_thread().name)
        if all(len(names) == 2 for names in used_by.values()):
            both_loaded.set()

    monkeypatch.setattr(Nft, "open", lambda nft: None)
    monkeypatch.setattr(Nft, "exists", lambda nft: False)
    monkeypatch.setattr(Nft, "rehearse", rehearse)
    monkeypatch.setattr(Nft, "run", run)
    enforcer = PolicyEnforcer("n1", (4, 6), 3600.0, Metrics())
    state = enforcer.state
    state.replace_namespaces([{"metadata": {"name": "ns"}}])
    state.replace_pods([pod("a", "10.0.0.2", {"app": "a"})])
    state.replace_policies([])
    state.replace_cluster_policies([])
    enforcer.start()
    try:
        assert both_loaded.wait(5), used_by
    finally:
        enforcer.stop()
    assert len(set(used_by[4])) == len(set(used_by[6])) == 1, used_by
    assert used_by[4] != used_by[6]


def unaddressed(name: str, labels: dict[str, str], uid: str = "") -> dict[str, Any]:
    """A pod of the node as the API knows it before kubelet wrote its addresses."""
    obj = pod(name, "10.0.0.9", labels)
    obj["metadata"]["uid"] = uid or name
    obj["status"] = {"phase": "Pending"}
    return obj


def test_a_pods_runtime_addresses_are_written_before_the_add_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loaded: list[str] = []
    monkeypatch.setattr(Nft, "run", lambda nft, text: loaded.append(text))
    monkeypatch.setattr(Nft, "exists", lambda nft: False)
    enforcer = PolicyEnforcer("n1", (4,), 3600.0, Metrics())
    state = enforcer.state
    state.replace_namespaces([{"metadata": {"name": "ns"}}])
    state.replace_pods([unaddressed("fresh", {"app": "web"})])
    isolating = {"metadata": {"namespace": "ns", "name": "p"}, "spec": {"podSelector": {}}}
    state.replace_policies([isolating])
    state.replace_cluster_policies([])
    syncing = threading.Thread(target=enforcer.runner.loop, daemon=True)
    syncing.start()
    try:
        assert enforcer.admit("ns", "fresh", "fresh", ("10.0.0.9",))
        assert "10.0.0.9 : jump ingress-" in "".join(loaded), "the pod's chain, before the ADD"
        # a pod made anew under the name is another pod: the old sandbox's address is not its
        state.pod_event("MODIFIED", unaddressed("fresh", {"app": "web"}, uid="other"))
        assert ("ns", "fresh") not in state.take()[0].pods
        enforcer.release("ns", "fresh")
        state.pod_event("MODIFIED", unaddressed("fresh", {"app": "web"}))
        assert ("ns", "fresh") not in state.take()[0].pods, "the DEL took the address back"
    finally:
        enforcer.runner.stop()


def test_an_add_for_a_pod_the_api_does_not_know_waits_for_it_then_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("proxyd.policy.enforcer.ADMISSION_WAIT", 0.1)
    enforcer = PolicyEnforcer("n1", (4,), 3600.0, Metrics())
    began = time.monotonic()
    assert not enforcer.admit("ns", "unknown", "", ("10.0.0.9",))
    assert time.monotonic() - began >= 0.1


def test_the_pod_of_a_call_is_the_one_its_runtime_names() -> None:
    args = "IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web-0;K8S_POD_UID=u1"
    assert sandbox_pod({"CNI_ARGS": args}) == ("ns", "web-0", "u1")
    assert sandbox_pod({"CNI_ARGS": "K8S_POD_NAME=web-0"}) is None, "no namespace"
    assert sandbox_pod({"CNI_ARGS": "not-an-arg"}) is None
    assert sandbox_pod({}) is None
