"""The README's main command: the lab comes up, shows traffic working, and goes away whole."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT, unique_name


def test_lab_up_shows_traffic_and_down_removes_everything(tmp_path):
    prefix = unique_name("kl")
    folder = tmp_path / "lab"
    lab = [sys.executable, str(ROOT / "deploy/lab/lab.py")]
    args = ["--prefix", prefix, "--folder", str(folder)]
    try:
        up = subprocess.run([*lab, "up", *args], capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        assert "pod-to-pod same node" in up.stdout and "pod-to-pod across nodes" in up.stdout
        assert "FAILED" not in up.stdout
        assert (folder / f"{prefix}-node1/etc/cni/net.d/10-knit.conflist").exists()
    finally:
        subprocess.run([*lab, "down", *args], check=True, timeout=120)
    assert (
        prefix not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )
    assert not folder.exists()
