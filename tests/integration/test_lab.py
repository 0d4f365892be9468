"""The README's main command: the lab comes up, shows traffic working with real pods, and goes
away whole, even when `down` runs in another process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from deploy.lab.netns import unique_name
from deploy.lab.paths import ROOT

SHOWN = (
    "pod-to-pod, direct route",
    "pod-to-pod, over VXLAN",
    "pod-to-Service by DNS name",
    "pod-to-apiserver through the `kubernetes` Service",
    "outside-to-NodePort",
)


def test_lab_up_shows_traffic_and_down_removes_everything(tmp_path):
    prefix = unique_name("kl")
    folder = tmp_path / "lab"
    lab = [sys.executable, "-m", "deploy.lab.lab"]
    args = ["--prefix", prefix, "--folder", str(folder)]
    try:
        up = subprocess.run(
            [*lab, "up", *args], capture_output=True, text=True, timeout=600, cwd=ROOT
        )
        assert up.returncode == 0, up.stdout + up.stderr
        for line in SHOWN:
            assert line in up.stdout
        # both families for each pod-to-pod check
        assert up.stdout.count(": OK") == len(SHOWN) + 2 and "FAILED" not in up.stdout
        for node in ("node1", "node2", "node3"):
            assert (folder / node / "etc/cni/net.d/10-knit.conflist").exists()
            assert (folder / node / "opt/cni/bin/knit").exists()
            assert (folder / node / "run/knit/cni.sock").exists()
    finally:
        subprocess.run([*lab, "down", *args], check=True, timeout=300, cwd=ROOT)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in namespaces
    processes = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(folder) not in processes
    assert not folder.exists()
    assert not list(Path("/sys/fs/cgroup").glob(f"*/{prefix}"))
    assert str(folder) not in Path("/proc/self/mountinfo").read_text()
