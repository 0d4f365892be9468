"""The policy enforcer's bookkeeping around its loads, with nft replaced (the tables it
writes, and the kernel taking them, are proven in tests/integration/test_network_policy.py
and test_nft_kernel.py)."""

from __future__ import annotations

from typing import Any

import pytest

from cni.nftables import NftError
from proxyd.metrics import Metrics
from proxyd.nftables.kernel import Nft
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

    monkeypatch.setattr(Nft, "run", run)
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
    enforcer.sync()
    assert loaded == [(6, 'add table ip6 knit-policy { comment "knit NetworkPolicy"; }')], (
        "IPv4's table was written and nothing changed; IPv6's is written whole again"
    )
    enforcer.stop()
