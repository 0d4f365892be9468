"""The CNI fast path: the plugin handing its calls to cni.server in the node namespace gives
the same answers as the plugin working in-process, and falls back to working in-process when
no daemon listens."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from cni.server import read_request
from deploy.lab.netns import Netns
from deploy.lab.paths import CNIDRIVER, REFERENCE_PLUGINS
from deploy.lab.process import eventually
from tests.support.cni_env import NETWORK, Node, bridge_conf
from tests.support.fastpath_daemon import (
    Daemon,
    build_launcher,
    hidden_netns,
    raw_call,
    running_daemon,
)

POD_MAC = "0a:58:0a:f4:01:0a"
POD_IP = "10.244.1.10"


@pytest.fixture
def daemon(node: Node, tmp_path: Path) -> Iterator[Daemon]:
    with running_daemon(node, tmp_path) as served:
        yield served


@pytest.fixture
def launchers(tmp_path: Path, daemon: Daemon) -> dict[str, Path]:
    return {
        "in-process": build_launcher(tmp_path / "plain", None),
        "fast": build_launcher(tmp_path / "fast", daemon.socket_path),
    }


def libcni(node: Node, tmp_path: Path, launcher: Path) -> Callable[..., str]:
    """libcni driving a conflist with knit (ipMasq, requested MAC and IP) from launcher's dir."""
    plugin = {
        k: v
        for k, v in bridge_conf(node.data_dir, ipMasq=True).items()
        if k not in ("cniVersion", "name")
    }
    plugin["capabilities"] = {"mac": True, "ips": True}
    path = tmp_path / "10-knit.conflist"
    path.write_text(json.dumps({"cniVersion": "1.1.0", "name": NETWORK, "plugins": [plugin]}))

    def drive(verb: str, pod: Netns) -> str:
        capabilities = json.dumps({"mac": POD_MAC, "ips": [f"{POD_IP}/24"]})
        files = ["--conflist", str(path), "--cache-dir", str(tmp_path / "cache")]
        files += ["--cni-path", f"{launcher.parent}:{REFERENCE_PLUGINS}"]
        attachment = ["--netns", pod.path, "--container-id", "pod"]
        call = [str(CNIDRIVER), verb, *files, *attachment, "--capability-args", capabilities]
        return node.ns.run(*call).stdout

    return drive


def without_node_macs(result: dict[str, Any]) -> dict[str, Any]:
    """The bridge's and the host veth's MACs are the kernel's choice at each ADD."""
    interfaces = [{k: v for k, v in i.items() if k != "mac"} for i in result["interfaces"][:2]]
    return {**result, "interfaces": interfaces + result["interfaces"][2:]}


def test_libcni_gets_the_same_answers_from_both_paths(
    node, make_netns, tmp_path, launchers, daemon
):
    pod = make_netns("pod")
    answers = {}
    for name, launcher in launchers.items():
        drive = libcni(node, tmp_path, launcher)
        added = json.loads(drive("add", pod))
        answers[name] = (without_node_macs(added), drive("check", pod), drive("del", pod))
        assert node.leftovers() == {}
        assert "eth0" not in pod.ip("link")
    assert answers["fast"] == answers["in-process"]
    result = answers["fast"][0]
    assert result["interfaces"][2]["mac"] == POD_MAC
    assert result["ips"][0]["address"] == f"{POD_IP}/24"
    daemon.wait_served(["ADD", "CHECK", "DEL"])
    assert daemon.served() == ["ADD", "CHECK", "DEL"], "only the fast path's calls reached it"


def test_answers_are_byte_identical(node, make_netns, tmp_path, launchers, daemon):
    pod = make_netns("pod")
    conf = bridge_conf(node.data_dir, runtimeConfig={"mac": POD_MAC, "ips": [POD_IP]})
    stdin = json.dumps(conf).encode()
    attachment = {"CNI_CONTAINERID": "pod", "CNI_NETNS": pod.path}
    outputs = {}
    for name, launcher in launchers.items():
        code, added = raw_call(node, launcher, "ADD", stdin, **attachment)
        assert code == 0, added
        result = json.loads(added)
        for interface in result["interfaces"][:2]:
            added = added.replace(interface["mac"].encode(), b"MAC")
        prev = json.dumps({**conf, "prevResult": result}).encode()
        outputs[name] = [
            added,
            raw_call(node, launcher, "CHECK", prev, **attachment),
            raw_call(node, launcher, "DEL", prev, **attachment),
        ]
    assert outputs["fast"] == outputs["in-process"]
    assert outputs["fast"][1:] == [(0, b""), (0, b"")]
    assert node.leftovers() == {}
    daemon.wait_served(["ADD", "CHECK", "DEL"])
    assert daemon.served() == ["ADD", "CHECK", "DEL"]


def with_range(conf: dict[str, Any], **options: Any) -> dict[str, Any]:
    ipam = conf["ipam"]
    return {**conf, "ipam": {**ipam, "ranges": [[{**ipam["ranges"][0][0], **options}]]}}


def test_errors_are_byte_identical(node, make_netns, tmp_path, launchers, daemon):
    conf = bridge_conf(node.data_dir, ipMasq=True)
    pod = make_netns("pod")
    add = {"CNI_CONTAINERID": "bad", "CNI_NETNS": pod.path}
    cases = [
        (6, b"{not json", add),
        (4, json.dumps(conf).encode(), {"CNI_CONTAINERID": "bad"}),
        (1, json.dumps({**conf, "cniVersion": "0.2.0"}).encode(), add),
        (7, json.dumps(with_range(conf, subnet="10.244.1.0/33")).encode(), add),
        (2, json.dumps({**conf, "hairpinmode": True}).encode(), add),
        (3, json.dumps(conf).encode(), {**add, "CNI_NETNS": "/var/run/netns/no-such-ns"}),
        (104, json.dumps({**conf, "ipam": {"type": "no-such-ipam"}}).encode(), add),
    ]
    for expected, stdin, env in cases:
        answers = {
            name: raw_call(node, launcher, "ADD", stdin, **env)
            for name, launcher in launchers.items()
        }
        assert answers["fast"] == answers["in-process"]
        code, output = answers["fast"]
        assert code == 1 and json.loads(output)["code"] == expected, output
    # The plugin runs the call naming a namespace it cannot open itself.
    daemon.wait_served(["ADD"] * (len(cases) - 1))
    assert node.leftovers() == {}


def test_a_delegated_ipam_plugin_gets_the_calls_own_variables(node, make_netns, tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "ref-host-local").symlink_to(REFERENCE_PLUGINS / "host-local")
    conf = bridge_conf(node.data_dir)
    conf["ipam"]["type"] = "ref-host-local"
    stdin = json.dumps(conf).encode()
    pod = make_netns("pod")
    with running_daemon(node, tmp_path / "daemon", bin_dirs=[plugins]) as daemon:
        launchers = {
            "in-process": build_launcher(tmp_path / "plain", None),
            "fast": build_launcher(tmp_path / "fast", daemon.socket_path),
        }
        for name, launcher in launchers.items():
            env = {"CNI_CONTAINERID": name, "CNI_NETNS": pod.path, "CNI_PATH": f"{plugins}"}
            code, added = raw_call(node, launcher, "ADD", stdin, **env)
            assert code == 0, added
            address = json.loads(added)["ips"][0]["address"].split("/")[0]
            owner = (node.data_dir / NETWORK / address).read_bytes()
            assert owner == f"{name}\r\neth0".encode(), "host-local saw the call's CNI_CONTAINERID"
            assert raw_call(node, launcher, "DEL", stdin, **env) == (0, b"")
            assert node.leftovers() == {}
        daemon.wait_served(["ADD", "DEL"])
        assert daemon.served() == ["ADD", "DEL"]


def test_falls_back_to_in_process_without_a_daemon(node, make_netns, tmp_path, daemon):
    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as bound_only:
        bound_only.bind(str(stale))  # a socket file nobody accepts on: ECONNREFUSED
        for socket_path in (tmp_path / "absent.sock", stale):
            launcher = build_launcher(tmp_path / socket_path.stem, socket_path)
            conf = json.dumps(bridge_conf(node.data_dir)).encode()
            pod = make_netns("pod")
            env = {"CNI_CONTAINERID": "fallback", "CNI_NETNS": pod.path}
            code, added = raw_call(node, launcher, "ADD", conf, **env)
            assert code == 0, added
            assert "eth0" in pod.ip("link")
            assert raw_call(node, launcher, "DEL", conf, **env) == (0, b"")
            assert node.leftovers() == {}
    assert daemon.served() == []


def test_32_concurrent_adds_through_the_daemon(node, make_netns, launchers, daemon):
    conf = json.dumps(bridge_conf(node.data_dir)).encode()
    pods = [make_netns("pod") for _ in range(32)]

    def call(command: str, i: int) -> tuple[int, bytes]:
        env = {"CNI_CONTAINERID": f"c{i}", "CNI_NETNS": pods[i].path}
        return raw_call(node, launchers["fast"], command, conf, **env)

    with ThreadPoolExecutor(max_workers=32) as pool:
        added = list(pool.map(lambda i: call("ADD", i), range(32)))
    assert all(code == 0 for code, _ in added), [out for code, out in added if code]
    assert len({json.loads(out)["ips"][0]["address"] for _, out in added}) == 32
    assert len(node.reservations()) == 32
    with ThreadPoolExecutor(max_workers=32) as pool:
        assert all(code == 0 for code, _ in pool.map(lambda i: call("DEL", i), range(32)))
    assert node.leftovers() == {}
    daemon.wait_served(["ADD"] * 32 + ["DEL"] * 32)


def test_a_daemon_gone_mid_call_gives_an_error_and_nothing_is_redone(node, make_netns, tmp_path):
    """A daemon that takes the call and dies: the plugin must not do the work a second time."""
    socket_path = tmp_path / "dying.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(socket_path))
    listener.listen()
    received = []

    def take_the_call_and_die() -> None:
        connection, _ = listener.accept()
        with connection:
            request = read_request(connection)
            request.close()
            received.append(request)

    thread = threading.Thread(target=take_the_call_and_die)
    thread.start()
    launcher = build_launcher(tmp_path / "dying", socket_path)
    pod = make_netns("pod")
    stdin = json.dumps(bridge_conf(node.data_dir)).encode()
    code, output = raw_call(node, launcher, "ADD", stdin, CNI_CONTAINERID="c", CNI_NETNS=pod.path)
    thread.join()
    listener.close()
    assert code == 1
    error = json.loads(output)
    assert error["code"] == 199 and error["cniVersion"] == "1.1.0"
    assert "closed the connection before answering" in error["msg"]
    environ = received[0].environ
    assert environ["CNI_COMMAND"] == "ADD" and received[0].stdin == stdin
    assert "PATH" not in environ, "only the CNI_* variables are forwarded"
    assert "eth0" not in pod.ip("link")
    assert node.leftovers() == {}


def test_a_namespace_the_daemon_cannot_see_is_served_through_the_plugins_descriptor(
    node, make_netns, tmp_path
):
    """The runtime's CNI_NETNS names nothing in the daemon's mount namespace (as /proc/<pid>/
    ns/net or a runtime's private bind mount would not): the plugin's descriptor carries it."""
    pod = make_netns("pod")
    hidden = hidden_netns(tmp_path, pod)
    netns_file, runtime = hidden.path, hidden.runtime
    with running_daemon(node, tmp_path / "daemon", through=hidden.hide) as daemon:
        assert not Path(f"/proc/{daemon.proc.pid}/root{netns_file}").exists()
        launcher = build_launcher(tmp_path / "fast", daemon.socket_path)
        conf = bridge_conf(node.data_dir)
        env = {"CNI_CONTAINERID": "hidden", "CNI_NETNS": str(netns_file)}
        code, added = raw_call(node, launcher, "ADD", json.dumps(conf).encode(), runtime, **env)
        assert code == 0, added
        result = json.loads(added)
        assert result["interfaces"][2]["sandbox"] == str(netns_file)
        assert "eth0" in pod.ip("link")
        prev = json.dumps({**conf, "prevResult": result}).encode()
        assert raw_call(node, launcher, "CHECK", prev, runtime, **env) == (0, b"")
        assert raw_call(node, launcher, "DEL", prev, runtime, **env) == (0, b"")
        assert "eth0" not in pod.ip("link")
        assert node.leftovers() == {}
        daemon.wait_served(["ADD", "CHECK", "DEL"])
        assert daemon.served() == ["ADD", "CHECK", "DEL"], "the daemon served, in that order"


def test_a_stopped_daemon_is_passed_over_and_runs_nothing_when_it_wakes(
    node, make_netns, tmp_path, daemon
):
    """SIGSTOP: the kernel still queues connections, so each call connects and sends; at the
    pickup deadline (2 s) the plugin hangs up and, its request unread, runs it in-process.
    The woken daemon then reads those requests, finds the hang-ups and runs none of them."""
    launcher = build_launcher(tmp_path / "fast", daemon.socket_path)
    conf = json.dumps(bridge_conf(node.data_dir)).encode()
    pod = make_netns("pod")
    env = {"CNI_CONTAINERID": "stopped", "CNI_NETNS": pod.path}
    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        code, added = raw_call(node, launcher, "ADD", conf, **env)
        assert time.monotonic() - started < 2 + 10, "the pickup deadline, then in-process"
        assert code == 0, added
        assert "eth0" in pod.ip("link")
        assert raw_call(node, launcher, "DEL", conf, **env) == (0, b"")
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    eventually(lambda: daemon.log.read_text().count("gave up waiting") == 2, 10, "both read")
    assert daemon.served() == []
    assert "eth0" not in pod.ip("link")
    assert node.leftovers() == {}
