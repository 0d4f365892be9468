"""The fast path's two ends without a kernel network: the plugin's client (cni.client) in a
real interpreter against a stand-in daemon, and cni.server on a socket in a temporary dir."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import posix
import socket
import stat
import subprocess
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cni import client, plugin, version
from cni.errors import CniError, Code
from cni.invocation import from_environ
from cni.ipam.delegate import Delegate
from cni.server import encode_response, read_request, serve

ROOT = Path(__file__).resolve().parent.parent.parent
# The client opens CNI_NETNS, so the calls name a file every process can open; not a network
# namespace (the host's own would be the one at hand), so no call served here ever reaches one.
CALL_NETNS = __file__
ADD_ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "c1",
    "CNI_NETNS": CALL_NETNS,
    "CNI_IFNAME": "eth0",
}
CONF = b'{"cniVersion": "1.0.0", "name": "n", "type": "knit"}'


def run_client(
    socket_path: Path | None,
    env: dict[str, str],
    stdin: bytes = CONF,
    prelude: str = "",
    flags: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[bytes]:
    """The plugin as the Makefile's launcher runs it: -I -S, its paths, cni.client.main."""
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT)!r}]; {prelude}"
        f"from cni.client import main; main({str(socket_path) if socket_path else None!r})"
    )
    return subprocess.run(
        [sys.executable, "-I", "-S", *flags, "-c", code],
        input=stdin,
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        timeout=30,
    )


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[Callable[[Callable[[socket.socket], None]], Path]]:
    """A daemon that accepts one call and handles it as the test says."""
    threads = []
    listeners = []

    def start(handle: Callable[[socket.socket], None]) -> Path:
        path = tmp_path / "stand-in.sock"
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(str(path))
        listener.listen()
        listeners.append(listener)

        def accept_one() -> None:
            connection, _ = listener.accept()
            with connection:
                handle(connection)

        thread = threading.Thread(target=accept_one, daemon=True)
        thread.start()
        threads.append(thread)
        return path

    yield start
    for thread in threads:
        thread.join(10)
    for listener in listeners:
        listener.close()


Received = list[tuple[dict[str, str], bytes, int | None]]


def take(received: Received) -> Callable[[socket.socket], None]:
    """A stand-in's handler: note the call (its namespace by inode) and answer exit 3."""

    def answer(connection: socket.socket) -> None:
        request = read_request(connection)
        inode = None if request.netns_fd is None else os.fstat(request.netns_fd).st_ino
        request.close()
        received.append((request.environ, request.stdin, inode))
        connection.sendall(encode_response(3, b'{"any": "bytes"}\n'))

    return answer


def test_the_daemons_answer_is_printed_with_its_exit_code(stand_in):
    received: Received = []
    path = stand_in(take(received))
    done = run_client(path, {**ADD_ENV, "OTHER": "x", "CNI_ARGS": "K8S_POD_NAME=p"})
    assert (done.returncode, done.stdout, done.stderr) == (3, b'{"any": "bytes"}\n', b"")
    environ, stdin, _ = received[0]
    assert environ == {**ADD_ENV, "CNI_ARGS": "K8S_POD_NAME=p"}, "only CNI_* is forwarded"
    assert stdin == CONF


def test_the_plugin_passes_the_namespace_it_opened(stand_in):
    received: Received = []
    done = run_client(stand_in(take(received)), ADD_ENV)
    assert done.returncode == 3
    assert received[0][2] == os.stat(CALL_NETNS).st_ino, "the client's netns came along"


@pytest.mark.parametrize("netns", ["", None])
def test_a_del_without_a_namespace_is_forwarded_without_a_descriptor(stand_in, netns):
    received: Received = []
    env = {**ADD_ENV, "CNI_COMMAND": "DEL"}
    if netns is None:
        del env["CNI_NETNS"]
    else:
        env["CNI_NETNS"] = netns
    assert run_client(stand_in(take(received)), env).returncode == 3
    assert received[0][2] is None


def test_a_namespace_the_plugin_cannot_open_is_not_forwarded(tmp_path):
    path = tmp_path / "cni.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen()
        listener.setblocking(False)
        env = {**ADD_ENV, "CNI_NETNS": str(tmp_path / "gone")}
        with_pyroute2 = f"sys.path.append({sysconfig.get_paths()['purelib']!r}); "
        done = run_client(path, env, prelude=with_pyroute2)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert (done.returncode, done.stdout) == plugin.execute(env, CONF)
    assert json.loads(done.stdout)["code"] == Code.UNKNOWN_CONTAINER


def test_a_forwarded_call_imports_only_c_modules(stand_in):
    def answer(connection: socket.socket) -> None:
        read_request(connection).close()
        connection.sendall(encode_response(0, b""))

    path = stand_in(answer)
    done = run_client(path, ADD_ENV, flags=("-X", "importtime"))
    assert done.returncode == 0, done.stderr
    imported = {
        line.split("|")[-1].strip()
        for line in done.stderr.decode().splitlines()
        if line.startswith("import time:") and not line.endswith("imported package")
    }
    startup = run_client(
        None, {}, prelude="import posix; posix._exit(0); ", flags=("-X", "importtime")
    )
    baseline = {
        line.split("|")[-1].strip()
        for line in startup.stderr.decode().splitlines()
        if line.startswith("import time:")
    }
    assert imported - baseline == {"cni", "cni.client", "_socket"}


def test_a_daemon_gone_before_answering_gives_the_error_json(stand_in):
    path = stand_in(lambda connection: read_request(connection).close())
    done = run_client(path, ADD_ENV)
    assert done.returncode == 1
    error = json.loads(done.stdout)
    assert error == {
        "cniVersion": "1.0.0",
        "code": 199,
        "msg": "the knit daemon closed the connection before answering",
    }
    assert done.stdout == plugin.encode(CniError(199, error["msg"]).to_json("1.0.0"))


def test_an_unreachable_daemon_is_named_in_the_calls_version(tmp_path):
    too_long = tmp_path / ("d" * 120) / "cni.sock"
    done = run_client(too_long, ADD_ENV, stdin=b'{"cniVersion": "0.4.0", "name": "n"}')
    assert done.returncode == 1
    error = json.loads(done.stdout)
    assert error["cniVersion"] == "0.4.0"
    assert error["msg"].startswith(f"cannot reach the knit daemon at {too_long}: ")


def test_a_half_answer_is_not_taken_for_an_answer(stand_in):
    def half(connection: socket.socket) -> None:
        read_request(connection).close()
        connection.sendall(encode_response(0, b'{"cniVersion": "1.1.0"}\n')[:-5])

    done = run_client(stand_in(half), ADD_ENV)
    assert done.returncode == 1 and json.loads(done.stdout)["code"] == 199


def test_a_daemon_of_another_protocol_is_named(stand_in):
    def newer(connection: socket.socket) -> None:
        connection.recv(1 << 16)
        connection.sendall(bytes((client.PROTOCOL + 1, 0)) + b"\0\0\0\0")

    done = run_client(stand_in(newer), ADD_ENV)
    assert done.returncode == 1
    assert json.loads(done.stdout) == {
        "cniVersion": "1.0.0",
        "code": 199,
        "msg": (
            f"the knit daemon speaks protocol {client.PROTOCOL + 1}, "
            f"this plugin speaks {client.PROTOCOL}"
        ),
    }


@pytest.mark.parametrize("situation", ["no socket file", "nobody listening", "no socket baked"])
def test_the_call_runs_in_process_without_a_daemon(tmp_path, situation):
    path = tmp_path / "cni.sock"
    if situation == "nobody listening":
        bound = socket.socket(socket.AF_UNIX)
        bound.bind(str(path))
    env = {k: v for k, v in ADD_ENV.items() if k != "CNI_IFNAME"}
    done = run_client(None if situation == "no socket baked" else path, env)
    assert (done.returncode, done.stdout) == plugin.execute(env, CONF)
    assert json.loads(done.stdout)["code"] == 4


def test_ld_library_path_is_dropped_before_anything_else(tmp_path):
    show = (
        "import cni.plugin, os, subprocess; "
        "cni.plugin.main = lambda: print(os.environ.get('LD_LIBRARY_PATH'), "
        "subprocess.run(['env'], capture_output=True, text=True).stdout.count('LD_LIBRARY'), "
        "end=''); "
    )
    done = run_client(None, {"CNI_COMMAND": "VERSION", "LD_LIBRARY_PATH": "/bundle"}, prelude=show)
    assert done.stdout == b"None 0"


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "run" / "knit" / "cni.sock"
    served = serve(str(path))
    yield path
    served.close()


def exchange(path: Path, request: bytes, netns_fd: int | None = None) -> bytes:
    with socket.socket(socket.AF_UNIX) as connection:
        connection.connect(str(path))
        client.send_request(connection, request, netns_fd)
        chunks = []
        while chunk := connection.recv(1 << 16):
            chunks.append(chunk)
    return b"".join(chunks)


def call(
    path: Path, environ: dict[str, str], stdin: bytes, netns: str | None = None
) -> tuple[int, bytes]:
    """A call as the plugin makes it, with a descriptor of netns (by default CNI_NETNS)."""
    env = b"\0".join(f"{k}={v}".encode() for k, v in environ.items())
    netns = environ.get("CNI_NETNS") if netns is None else netns
    netns_fd = os.open(netns, os.O_RDONLY) if netns else None
    try:
        answer = exchange(path, client.encode_request(env, stdin), netns_fd)
    finally:
        if netns_fd is not None:
            os.close(netns_fd)
    return client.decode_response(answer, stdin)


def test_the_server_answers_as_the_plugin_does(server):
    for env, stdin in [
        ({k: v for k, v in ADD_ENV.items() if k != "CNI_IFNAME"}, CONF),
        (ADD_ENV, b"{not json"),
        ({**ADD_ENV, "CNI_COMMAND": "DEL"}, b'{"cniVersion": "9.9.9", "name": "n"}'),
    ]:
        assert call(server, env, stdin) == plugin.execute(env, stdin)


def test_the_server_refuses_a_namespace_without_its_descriptor(server):
    code, output = call(server, ADD_ENV, CONF, netns="")
    assert code == 1
    assert json.loads(output) == {
        "cniVersion": version.LATEST,
        "code": 199,
        "msg": f"the plugin named CNI_NETNS {CALL_NETNS} without passing its descriptor",
    }


def test_a_descriptor_that_is_not_a_network_namespace_is_named(server, tmp_path):
    not_a_netns = tmp_path / "file"
    not_a_netns.write_text("")
    env = {**ADD_ENV, "CNI_NETNS": str(not_a_netns)}
    answer = call(server, env, CONF)
    assert answer == plugin.execute(env, CONF)
    error = json.loads(answer[1])
    assert error["code"] == Code.UNKNOWN_CONTAINER
    assert error["msg"] == f"{not_a_netns} is not a network namespace"


def test_the_server_serves_only_attachment_verbs(server):
    code, output = call(server, {"CNI_COMMAND": "VERSION"}, b'{"cniVersion": "0.4.0"}')
    assert code == 1
    assert json.loads(output) == {
        "cniVersion": "0.4.0",
        "code": 199,
        "msg": "the knit daemon serves ADD, CHECK, DEL, not 'VERSION'",
    }


def test_the_server_names_a_mismatching_protocol(server):
    answer = exchange(server, bytes((client.PROTOCOL + 1,)) + b"\0" * 8)
    assert answer[0] == client.PROTOCOL and answer[1] == 1
    assert json.loads(answer[6:])["msg"] == (
        f"the plugin speaks protocol {client.PROTOCOL + 1}, "
        f"this knit daemon speaks {client.PROTOCOL}"
    )


def test_the_socket_is_private_and_removed_on_close(tmp_path):
    path = tmp_path / "run" / "knit" / "cni.sock"
    served = serve(str(path))
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    served.close()
    assert not path.exists()


def test_a_stale_socket_is_replaced_and_a_successor_kept(tmp_path):
    path = tmp_path / "cni.sock"
    with socket.socket(socket.AF_UNIX) as stale:
        stale.bind(str(path))
        first = serve(str(path))
    second = serve(str(path))
    first.close()
    assert path.exists(), "closing the old server leaves its successor's socket"
    code, _ = call(path, {"CNI_COMMAND": "DEL"}, b"{}")
    assert code == 1 and second.calls == 1
    second.close()
    assert not path.exists()


def test_something_else_at_the_socket_path_is_left_alone(tmp_path):
    path = tmp_path / "cni.sock"
    path.write_text("not a socket")
    with pytest.raises(FileExistsError):
        serve(str(path))
    assert path.read_text() == "not a socket"


def test_a_delegated_plugin_sees_the_calls_variables_and_the_process_path(tmp_path, monkeypatch):
    script = tmp_path / "show-env"
    script.write_text(
        '#!/bin/sh\nprintf \'{"code": 104, "msg": "%s %s %s"}\' '
        '"$CNI_COMMAND" "$CNI_CONTAINERID" "$(command -v sh)"\nexit 1\n'
    )
    script.chmod(0o755)
    monkeypatch.setenv("CNI_CONTAINERID", "the-daemons-own")
    invocation = from_environ({**ADD_ENV, "CNI_PATH": str(tmp_path)})
    with pytest.raises(CniError) as err:
        Delegate("show-env", b"{}", invocation).release("c1", "eth0")
    assert err.value.msg.split()[:2] == ["DEL", "c1"]
    assert err.value.msg.split()[2].endswith("/sh"), "PATH comes from the process"


def test_a_delegated_plugin_opens_the_namespace_the_fast_path_received(tmp_path: Path) -> None:
    """With the plugin's descriptor the child gets it, as CNI_NETNS /proc/self/fd/<n>: the
    daemon may not resolve the runtime's path. In-process calls pass the path on."""
    script = tmp_path / "show-netns"
    script.write_text(
        '#!/bin/sh\nprintf \'{"code": 104, "msg": "%s %s"}\' "$CNI_NETNS" "$(cat "$CNI_NETNS")"\n'
        "exit 1\n"
    )
    script.chmod(0o755)
    stand_in = tmp_path / "netns"
    stand_in.write_text("stand-in")
    env = {**ADD_ENV, "CNI_NETNS": str(stand_in), "CNI_PATH": str(tmp_path)}
    with pytest.raises(CniError) as err:
        Delegate("show-netns", b"{}", from_environ(env)).release("c1", "eth0")
    assert err.value.msg == f"{stand_in} stand-in"
    fd = os.open(stand_in, os.O_RDONLY | os.O_CLOEXEC)
    try:
        stand_in.unlink()
        with pytest.raises(CniError) as err:
            Delegate("show-netns", b"{}", from_environ(env, fd)).release("c1", "eth0")
    finally:
        os.close(fd)
    assert err.value.msg == f"/proc/self/fd/{fd} stand-in"


@pytest.mark.parametrize("answer", ["not json", '{"ips": [{"address": "10.0.0.300/24"}]}'])
def test_an_undecodable_delegated_add_is_given_back(tmp_path, answer):
    script = tmp_path / "odd-ipam"
    script.write_text(
        f'#!/bin/sh\necho "$CNI_COMMAND" >> "{tmp_path}/calls"\n'
        f"[ \"$CNI_COMMAND\" = ADD ] && printf '%s' '{answer}'\nexit 0\n"
    )
    script.chmod(0o755)
    invocation = from_environ({**ADD_ENV, "CNI_PATH": str(tmp_path)})
    with pytest.raises(CniError) as err:
        Delegate("odd-ipam", b"{}", invocation).add("c1", "eth0")
    assert err.value.code == Code.DECODE_FAILURE
    assert (tmp_path / "calls").read_text().split() == ["ADD", "DEL"]


def test_a_delegated_add_without_addresses_is_given_back(tmp_path):
    script = tmp_path / "empty-ipam"
    script.write_text(
        f'#!/bin/sh\necho "$CNI_COMMAND" >> "{tmp_path}/calls"\n'
        '[ "$CNI_COMMAND" = ADD ] && printf \'{"cniVersion": "1.0.0", "dns": {}}\'\nexit 0\n'
    )
    script.chmod(0o755)
    invocation = from_environ({**ADD_ENV, "CNI_PATH": str(tmp_path)})
    with pytest.raises(CniError) as err:
        Delegate("empty-ipam", b"{}", invocation).add("c1", "eth0")
    assert err.value.code == Code.DELEGATE_FAILURE
    assert err.value.msg == "IPAM plugin empty-ipam returned missing IP config"
    assert (tmp_path / "calls").read_text().split() == ["ADD", "DEL"]


def test_a_fifo_as_cni_netns_does_not_hold_the_fast_path_client(tmp_path, monkeypatch):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    monkeypatch.setitem(posix.environ, b"CNI_NETNS", bytes(fifo))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        opened = pool.submit(client.open_netns)
        try:
            fd = opened.result(timeout=5)
        finally:
            # a blocked open() ends once a writer shows up
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    assert fd is not None
    os.close(fd)
