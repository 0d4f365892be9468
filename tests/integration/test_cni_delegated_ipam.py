"""A delegated IPAM plugin run by the node daemon: it opens the pod's network namespace even
when the runtime's CNI_NETNS names nothing in the daemon's mount namespace; it is run only
from the daemon's bin dirs, sees none of the daemon's environment and is killed at its
deadline, leaving nothing behind."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from cni.invocation import SPEC_VARIABLES
from deploy.lab.netns import Netns
from tests.support.cni_env import Node, bridge_conf
from tests.support.fastpath_daemon import (
    DAEMON_ENV,
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
    plugins = tmp_path / "plugins"
    daemon_dir = tmp_path / "daemon"
    with running_daemon(node, daemon_dir, through=hidden.hide, bin_dirs=[plugins]) as daemon:
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


# Answers ADD with an address and records each call's verb and environment's names; hangs on
# ADD when its config says so, after noting its pid.
MARKING_IPAM = """#!{python} -I
import json, os, sys, time
conf = json.load(sys.stdin)
seen = {{"command": os.environ["CNI_COMMAND"], "pid": os.getpid(), "env": sorted(os.environ)}}
with open({record!r}, "a") as record:
    record.write(json.dumps(seen) + "\\n")
if seen["command"] == "ADD":
    if conf["ipam"].get("hang"):
        time.sleep(600)
    address = {{"address": "10.244.1.60/24", "gateway": "10.244.1.1"}}
    print(json.dumps({{"cniVersion": "1.1.0", "ips": [address]}}))
"""


def marking_ipam(directory: Path, record: Path) -> None:
    directory.mkdir()
    script = directory / "marking-ipam"
    script.write_text(MARKING_IPAM.format(python=sys.executable, record=str(record)))
    script.chmod(0o755)


def recorded(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def test_cni_path_outside_the_daemons_bin_dirs_runs_nothing_in_the_daemon(
    node: Node, make_netns: Callable[[str], Netns], tmp_path: Path
) -> None:
    """The caller's CNI_PATH may narrow the daemon's bin dirs, never widen them: a plugin in
    a folder of the caller's is not found. In-process, the runtime runs it, as the spec says."""
    allowed, outside = tmp_path / "bin", tmp_path / "outside"
    allowed.mkdir()
    record = tmp_path / "calls.jsonl"
    marking_ipam(outside, record)
    pod = make_netns("pod")
    stdin = json.dumps({**bridge_conf(node.data_dir), "ipam": {"type": "marking-ipam"}}).encode()
    with running_daemon(node, tmp_path / "daemon", bin_dirs=[allowed]) as daemon:
        fast = build_launcher(tmp_path / "fast", daemon.socket_path)
        for search in (f"{outside}", f"{outside}:{allowed}", f"{allowed}/../outside"):
            env = {"CNI_CONTAINERID": "c", "CNI_NETNS": pod.path, "CNI_PATH": search}
            code, output = raw_call(node, fast, "ADD", stdin, **env)
            assert code == 1 and json.loads(output)["code"] == 104, output
            assert "not found in CNI_PATH" in json.loads(output)["msg"]
        daemon.wait_served(["ADD"] * 3)
    assert recorded(record) == [], "the daemon ran nothing"
    assert "eth0" not in pod.ip("link")
    assert node.leftovers() == {}
    plain = build_launcher(tmp_path / "plain", None)
    env = {"CNI_CONTAINERID": "c", "CNI_NETNS": pod.path, "CNI_PATH": str(outside)}
    assert raw_call(node, plain, "ADD", stdin, **env)[0] == 0
    assert raw_call(node, plain, "DEL", stdin, **env) == (0, b"")
    assert [call["command"] for call in recorded(record)] == ["ADD", "DEL"]
    assert node.leftovers() == {}


def test_the_daemons_delegated_plugin_sees_no_daemon_variable_and_is_killed_at_its_deadline(
    node: Node, make_netns: Callable[[str], Netns], tmp_path: Path
) -> None:
    plugins, record = tmp_path / "plugins", tmp_path / "calls.jsonl"
    marking_ipam(plugins, record)
    pod = make_netns("pod")
    conf = {**bridge_conf(node.data_dir), "ipam": {"type": "marking-ipam"}}
    env = {"CNI_CONTAINERID": "c", "CNI_NETNS": pod.path, "CNI_PATH": str(plugins)}
    daemon_dir = tmp_path / "daemon"
    with running_daemon(node, daemon_dir, bin_dirs=[plugins], delegate_deadline=1) as daemon:
        fast = build_launcher(tmp_path / "fast", daemon.socket_path)
        code, added = raw_call(node, fast, "ADD", json.dumps(conf).encode(), **env)
        assert code == 0, added
        assert raw_call(node, fast, "DEL", json.dumps(conf).encode(), **env) == (0, b"")
        hanging = json.dumps({**conf, "ipam": {**conf["ipam"], "hang": True}}).encode()
        started = time.monotonic()
        code, output = raw_call(node, fast, "ADD", hanging, **env)
        assert time.monotonic() - started < 10
        daemon.wait_served(["ADD", "DEL", "ADD"])
    assert code == 1
    error = json.loads(output)
    assert (error["code"], error["msg"]) == (
        104,
        "IPAM plugin marking-ipam ADD did not answer in 1 s: killed",
    )
    calls = recorded(record)
    assert [call["command"] for call in calls] == ["ADD", "DEL", "ADD", "DEL"], "given back"
    for call in calls:
        names = set(call["env"]) - {"LC_CTYPE"}  # the plugin's interpreter may set it
        assert names == {*SPEC_VARIABLES, "PATH"} - {"CNI_ARGS"}, call
        assert not names & set(DAEMON_ENV) - set(SPEC_VARIABLES)
    assert not Path(f"/proc/{calls[2]['pid']}").exists(), "the hung ADD was killed"
    assert "eth0" not in pod.ip("link")
    assert node.leftovers() == {}
