"""The node's CNI configuration: rendered from its podCIDRs (pure), written atomically."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

NETWORK_NAME = "knit"
BRIDGE = "knit0"
CONFLIST_NAME = "10-knit.conflist"
# The list's cniVersion is what a runtime without version negotiation uses: libcni before 1.2
# (containerd 1.6 and 1.7) refuses a result version it does not know, and it knows 1.0.0 at
# most. cniVersions lets libcni 1.2+ (containerd 2.x, CRI-O) pick the newest it shares with the
# list, so those runtimes still get STATUS and GC, which need 1.1.0.
CNI_VERSION = "1.0.0"
CNI_VERSIONS = ["1.0.0", "1.1.0"]


def render(pod_cidrs: tuple[str, ...], data_dir: str, mtu: int) -> dict[str, Any]:
    """knit on a gateway bridge with host-local over the pod CIDRs, then portmap for hostPorts.

    Egress masquerade is the daemon's (by cluster CIDR), so the plugin's own ipMasq is off.
    """
    return {
        "cniVersion": CNI_VERSION,
        "cniVersions": CNI_VERSIONS,
        "name": NETWORK_NAME,
        "plugins": [
            {
                "type": "knit",
                "bridge": BRIDGE,
                "isGateway": True,
                "isDefaultGateway": True,
                "hairpinMode": True,
                "mtu": mtu,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": cidr}] for cidr in pod_cidrs],
                    "dataDir": data_dir,
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def write_if_changed(conf_dir: Path, conf: dict[str, Any]) -> bool:
    """Write conf_dir/10-knit.conflist by rename unless it already holds conf."""
    path = conf_dir / CONFLIST_NAME
    text = json.dumps(conf, indent=2) + "\n"
    try:
        if path.read_text() == text:
            return False
    except FileNotFoundError:
        pass
    conf_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{CONFLIST_NAME}.", dir=conf_dir)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def read(conf_dir: Path) -> dict[str, Any] | None:
    """The knit plugin's entry of the conflist on disk, with the list's name and version."""
    try:
        conflist = json.loads((conf_dir / CONFLIST_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None
    for plugin in conflist.get("plugins") or []:
        if plugin.get("type") == "knit":
            return {
                **plugin,
                "name": conflist.get("name", NETWORK_NAME),
                "cniVersion": conflist.get("cniVersion", CNI_VERSION),
            }
    return None
