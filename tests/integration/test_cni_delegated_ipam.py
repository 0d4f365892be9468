"""A delegated IPAM plugin run by the node daemon opens the pod's network namespace even when
the runtime's CNI_NETNS names nothing in the daemon's mount namespace."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from deploy.lab.netns import Netns
from tests.integration.cni_env import Node, bridge_conf
from tests.integration.test_fastpath import (
    build_launcher,
    hidden_netns,
    raw_call,
    running_daemon,
)

IPAM_TYPE = "netns-recording-ipam"
# Records the CNI_NETNS it got and what opening it finds; answers ADD with one address, and
# fails (code 5) when it cannot open the namespace.
RECORDING_IPAM = """#!{python} -I
import fcntl, json, os, sys
NS_GET_NSTYPE, CLONE_NEWNET = 0xB703, 0x40000000
seen = {{"command": os.environ["CNI_COMMAND"], "netns": os.environ.get("CNI_NETNS", "")}}
try:
    fd = os.open(seen["netns"], os.O_RDONLY)
    seen["inode"] = os.fstat(fd).st_ino
    seen["netns_type"] = fcntl.ioctl(fd, NS_GET_NSTYPE) == CLONE_NEWNET
except OSError as err:
    seen["error"] = str(err)
with open({record!r}, "a") as record:
    record.write(json.dumps(seen) + "\\n")
if "error" in seen:
    print(json.dumps({{"cniVersion": "1.1.0", "code": 5, "msg": "IPAM: " + seen["error"]}}))
    sys.exit(1)
if seen["command"] == "ADD":
    address = {{"address": "10.244.1.50/24", "gateway": "10.244.1.1"}}
    print(json.dumps({{"cniVersion": "1.1.0", "ips": [address]}}))
"""


def recording_ipam(directory: Path, record: Path) -> None:
    directory.mkdir()
    script = directory / IPAM_TYPE
    script.write_text(RECORDING_IPAM.format(python=sys.executable, record=str(record)))
    script.chmod(0o755)


def test_cni_delegated_ipam_opens_a_namespace_the_daemon_cannot_see(
    node: Node, make_netns: Callable[[str], Netns], tmp_path: Path
) -> None:
    pod = make_netns("pod")
    hidden = hidden_netns(tmp_path, pod)
    record = tmp_path / "ipam-calls.jsonl"
    recording_ipam(tmp_path / "plugins", record)
    conf = {**bridge_conf(node.data_dir), "ipam": {"type": IPAM_TYPE}}
    stdin = json.dumps(conf).encode()
    with running_daemon(node, tmp_path / "daemon", through=hidden.hide) as daemon:
        assert not Path(f"/proc/{daemon.proc.pid}/root{hidden.path}").exists()
        launchers = {
            "fast": build_launcher(tmp_path / "fast", daemon.socket_path),
            "in-process": build_launcher(tmp_path / "plain", None),
        }
        for name, launcher in launchers.items():
            env = {
                "CNI_CONTAINERID": name,
                "CNI_NETNS": str(hidden.path),
                "CNI_PATH": str(tmp_path / "plugins"),
            }
            code, added = raw_call(node, launcher, "ADD", stdin, hidden.runtime, **env)
            assert code == 0, added
            assert json.loads(added)["ips"][0]["address"] == "10.244.1.50/24"
            prev = json.dumps({**conf, "prevResult": json.loads(added)}).encode()
            assert raw_call(node, launcher, "CHECK", prev, hidden.runtime, **env) == (0, b"")
            assert raw_call(node, launcher, "DEL", prev, hidden.runtime, **env) == (0, b"")
            assert "eth0" not in pod.ip("link")
            assert node.leftovers() == {}
        daemon.wait_served(["ADD", "CHECK", "DEL"])
    calls = [json.loads(line) for line in record.read_text().splitlines()]
    assert [call["command"] for call in calls] == ["ADD", "CHECK", "DEL"] * 2
    inode = os.stat(pod.path).st_ino
    for served, call in zip(["fast"] * 3 + ["in-process"] * 3, calls, strict=True):
        assert call.get("inode") == inode and call.get("netns_type"), (served, call)
        if served == "fast":
            assert re.fullmatch(r"/proc/self/fd/\d+", call["netns"]), call
        else:
            assert call["netns"] == str(hidden.path), "in-process calls pass the path on"
