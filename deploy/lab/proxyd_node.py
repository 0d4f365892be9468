"""knit-proxyd started inside a node namespace: the one way the lab, the tests and the benches
build its command line, with every path a real node keeps on disk pointed at the node's own
folder."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from deploy.lab.controlplane import die_with_parent
from deploy.lab.netns import Netns
from deploy.lab.paths import ROOT
from deploy.lab.process import checkout_path


@dataclass(frozen=True)
class NodeFiles:
    """Where the daemon writes the CNI config, installs the plugin and keeps IPAM data."""

    conf_dir: Path
    bin_dir: Path
    data_dir: Path
    socket: str = ""
    """The fast path's socket; empty: no fast path."""
    bundle: str = ""
    """The plugin bundle to install into bin_dir; empty: install nothing."""

    def flags(self) -> list[str]:
        return [
            "--cni-conf-dir", str(self.conf_dir),
            "--cni-bin-dir", str(self.bin_dir),
            "--cni-data-dir", str(self.data_dir),
            "--cni-socket", self.socket,
            "--cni-bundle", self.bundle,
        ]  # fmt: skip


def proxyd_flags(
    kubeconfig: Path,
    name: str,
    cluster_cidrs: str,
    files: NodeFiles,
    *extra: str,
    mode: str = "iptables",
    routing: str = "none",
) -> list[str]:
    """The daemon's flags for node `name`: none of the host's paths, and (routing "none") no
    routes to other nodes unless asked."""
    return [
        "--kubeconfig", str(kubeconfig),
        "--hostname-override", name,
        "--cluster-cidr", cluster_cidrs,
        *files.flags(),
        "--routing", routing,
        "--proxy-mode", mode,
        *extra,
    ]  # fmt: skip


def proxyd_argv(ns: str, flags: list[str], *python: str) -> list[str]:
    """The command running the daemon in namespace ns (`ip netns exec` execs it, so its pid is
    the daemon's); `python`: interpreter options before `-m proxyd`."""
    return ["ip", "netns", "exec", ns, sys.executable, *python, "-m", "proxyd", *flags]


def launch_proxyd(ns: Netns, flags: list[str], log: Path, *python: str) -> subprocess.Popen[bytes]:
    """The daemon in ns, its output appended to log, killed when the launching thread ends."""
    with log.open("ab") as out:
        return subprocess.Popen(
            proxyd_argv(ns.name, flags, *python),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **checkout_path()},
            preexec_fn=die_with_parent,
        )
