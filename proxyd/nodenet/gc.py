"""Start-up garbage collection of the node's IPAM reservations.

After a reboot (or a crash of the runtime) the dataDir may hold reservations of pods that no
longer exist. A pod exists on this node when its host veth does: the plugin names it from
(network, container ID, ifname), so the kernel's links are the list of pods actually here.
The plugin's own GC verb then releases the rest (and any rule tagged with them). Reservations
younger than GRACE_SECONDS are kept: an ADD may be between reserving and creating its veth.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from cni.bridge import host_veth_name
from cni.invocation import from_environ
from cni.ipam.store import Store
from cni.plugin import run
from proxyd.nodenet import kernel

log = logging.getLogger(__name__)

GRACE_SECONDS = 30.0


def _link_names() -> set[str]:
    with kernel.route_socket() as sock:
        return kernel.link_names(sock)


def live_attachments(plugin: dict[str, Any], links: set[str], now: float) -> set[tuple[str, str]]:
    """The attachments in the dataDir that still have their veth, or are too recent to judge."""
    network = plugin["name"]
    store = Store(plugin["ipam"]["dataDir"], network)
    live = set()
    for ip, (cid, ifname) in store.reservations().items():
        try:
            age = now - (store.directory / str(ip)).stat().st_mtime
        except FileNotFoundError:
            continue
        if not ifname or age < GRACE_SECONDS or host_veth_name(network, cid, ifname) in links:
            live.add((cid, ifname))
    return live


def collect(plugin: dict[str, Any] | None, cni_bin_dir: Path) -> int:
    """Release the reservations of pods that are gone; returns how many there were."""
    ipam = (plugin or {}).get("ipam") or {}
    # In-process host-local only: a delegated IPAM plugin would wait for the lock held here.
    if plugin is None or ipam.get("type") != "host-local" or "dataDir" not in ipam:
        return 0
    store = Store(ipam["dataDir"], plugin["name"])
    # The scan and the release under one hold of the lock, which the GC verb's host-local
    # takes again in this thread: an ADD reserving between them would be missing from the
    # live set and lose its address while its pod uses it.
    with store.locked():
        before = len(store.reservations())
        live = live_attachments(plugin, _link_names(), time.time())
        request = {
            **plugin,
            "cniVersion": "1.1.0",
            "cni.dev/valid-attachments": [{"containerID": c, "ifname": i} for c, i in sorted(live)],
        }
        run(
            from_environ({"CNI_COMMAND": "GC", "CNI_PATH": str(cni_bin_dir)}),
            json.dumps(request).encode(),
        )
        released = before - len(store.reservations())
    if released:
        log.info("released %d addresses of pods no longer on this node", released)
    return released
