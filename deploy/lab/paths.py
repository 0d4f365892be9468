"""Where the checkout keeps what the builds make: the one list of the `build/` paths the lab,
the tests and the benches read (`make setup`, `make go-tools` and tests/go/build.sh write
them)."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "build"
CONTROLPLANE_BIN = BUILD / "controlplane"
"""etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubelet, kubectl."""
NODE_BIN = BUILD / "node"
"""containerd 2.x, its shim and ctr, CoreDNS."""
REFERENCE_PLUGINS = BUILD / "refcni"
"""containernetworking/plugins: bridge, host-local, loopback, portmap..."""
PLUGIN_DIR = Path(os.environ.get("KNIT_PLUGIN_DIR", BUILD / "cni"))
"""knit's own plugin, as `make cni` builds it; KNIT_PLUGIN_DIR names another build of it (a
VM node's, deploy/lab/plugin_dir.py)."""
CNIDRIVER = BUILD / "tools" / "cnidriver"
"""A runtime's half of CNI: libcni loading a conflist and calling its plugins."""
IMAGES = BUILD / "images"
E2E = BUILD / "e2e"
