"""The daemon's start-up IPAM GC against an ADD running beside it, on a temporary dataDir.

No kernel: the node's links are given, and the GC verb's masquerade and spoof-check clean-up
(which would act on this machine's own firewall) are left out."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cni import masq, spoofcheck
from cni.ipam.hostlocal import HostLocal, parse_conf
from cni.ipam.store import Store
from proxyd.nodenet import conflist, gc


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The knit entry of the conflist the daemon writes, on a node without any pod veth."""
    conf_dir = tmp_path / "net.d"
    conflist.write_if_changed(
        conf_dir, conflist.render(("10.244.1.0/24",), str(tmp_path / "ipam"), 1450)
    )
    monkeypatch.setattr(gc, "_link_names", set)
    monkeypatch.setattr(masq, "teardown", lambda *args: None)
    monkeypatch.setattr(spoofcheck, "teardown", lambda *args: None)
    entry = conflist.read(conf_dir)
    assert entry is not None
    return entry


def host_local(plugin: dict[str, Any]) -> HostLocal:
    return HostLocal(parse_conf(plugin, plugin["name"], {}))


def test_an_add_between_the_gcs_scan_and_its_release_keeps_its_address(
    plugin: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The live set is computed under the IPAM lock: an ADD that reserved after a scan made
    outside it was not in that set, and the GC gave its address away while its pod used it."""
    ipam = host_local(plugin)
    gone = ipam.add("pod-gone", "eth0").ips[0].address.ip
    store = Store(plugin["ipam"]["dataDir"], plugin["name"])
    aged = time.time() - 2 * gc.GRACE_SECONDS
    os.utime(store.directory / str(gone), (aged, aged))

    scan = gc.live_attachments
    added: list[str] = []
    adder = threading.Thread(
        target=lambda: added.append(str(host_local(plugin).add("pod-new", "eth0").ips[0].address))
    )

    def scan_then_let_an_add_run(*args: Any) -> set[tuple[str, str]]:
        live = scan(*args)
        adder.start()
        adder.join(0.5)  # done by now unless the GC holds the lock
        return live

    monkeypatch.setattr(gc, "live_attachments", scan_then_let_an_add_run)
    gc.collect(plugin, tmp_path / "bin")
    adder.join(10)
    assert added, "the ADD finished"
    assert store.reservations() == {ipam.store.last_reserved(0): ("pod-new", "eth0")}, (
        "the gone pod's address released, the new pod's kept"
    )
