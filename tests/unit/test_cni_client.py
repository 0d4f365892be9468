"""The fast path's two ends without a kernel network: the plugin's compiled client
(cni/client.c) against a stand-in daemon, with the Python plugin it execs (cni.in_process), and
cni.server on a socket in a temporary dir."""

from __future__ import annotations

import json
import os
import queue
import re
import select
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cni import in_process, plugin, version
from cni.errors import CniError, Code
from cni.invocation import call_deadline, from_environ
from cni.ipam import delegate
from cni.ipam.delegate import MINIMAL_PATH, Delegate
from cni.server import (
    DECLINED,
    LENGTH_BYTES,
    PROTOCOL,
    SERVED,
    encode_response,
    read_request,
    serve,
)
from deploy.lab.paths import ROOT
from tests.support.fastpath import (
    IN_PROCESS,
    call_plugin,
    compile_client,
    decode_response,
    encode_request,
    receive_all,
    send_request,
    set_up_client,
)

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


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_client(tmp_path_factory.mktemp("client"))


@pytest.fixture
def run_client(compiled: Path, tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[bytes]]:
    """The client in a CNI bin directory of its own, its daemon's socket being socket_path."""

    def run(
        socket_path: Path | None,
        env: dict[str, str],
        stdin: bytes = CONF,
        in_process: str = IN_PROCESS,
    ) -> subprocess.CompletedProcess[bytes]:
        executable = set_up_client(tmp_path / "bin", compiled, socket_path, in_process)
        return call_plugin(executable, env, stdin)

    return run


@pytest.fixture
def stand_in(tmp_path: Path) -> Iterator[Callable[[Callable[[socket.socket], None]], Path]]:
    """A daemon that accepts one call and handles it as the test says."""
    threads = []
    listeners = []

    def start(handle: Callable[[socket.socket], None]) -> Path:
        path = tmp_path / f"stand-in-{len(listeners)}.sock"
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


def take(received: Received, code: int = 3) -> Callable[[socket.socket], None]:
    """A stand-in's handler: note the call (its namespace by inode) and answer `code`."""

    def answer(connection: socket.socket) -> None:
        request = read_request(connection)
        inode = None if request.netns_fd is None else os.fstat(request.netns_fd).st_ino
        request.close()
        received.append((request.environ, request.stdin, inode))
        connection.sendall(encode_response(code, b'{"any": "bytes"}\n'))

    return answer


def test_the_client_speaks_the_servers_protocol():
    source = (ROOT / "cni" / "client.c").read_text()
    defined = dict(re.findall(r"^#define (PROTOCOL|DECLINED|LENGTH_BYTES) (\d+)$", source, re.M))
    assert defined == {
        "PROTOCOL": str(PROTOCOL),
        "DECLINED": str(DECLINED),
        "LENGTH_BYTES": str(LENGTH_BYTES),
    }
    assert f'#define ERROR_VARIABLE "{in_process.ERROR_VARIABLE}"' in source
    verbs = set(re.findall(r'strcmp\(command, "(\w+)"\)', source))
    assert verbs == SERVED


def test_the_daemons_answer_is_printed_with_its_exit_code(run_client, stand_in):
    received: Received = []
    path = stand_in(take(received))
    done = run_client(path, {**ADD_ENV, "OTHER": "x", "CNI_ARGS": "K8S_POD_NAME=p"})
    assert (done.returncode, done.stdout, done.stderr) == (3, b'{"any": "bytes"}\n', b"")
    environ, stdin, _ = received[0]
    assert environ == {**ADD_ENV, "CNI_ARGS": "K8S_POD_NAME=p"}, "only CNI_* is forwarded"
    assert stdin == CONF


def test_the_plugin_passes_the_namespace_it_opened(run_client, stand_in):
    received: Received = []
    done = run_client(stand_in(take(received)), ADD_ENV)
    assert done.returncode == 3
    assert received[0][2] == os.stat(CALL_NETNS).st_ino, "the client's netns came along"


@pytest.mark.parametrize("netns", ["", None])
def test_a_del_without_a_namespace_is_forwarded_without_a_descriptor(run_client, stand_in, netns):
    received: Received = []
    env = {**ADD_ENV, "CNI_COMMAND": "DEL"}
    if netns is None:
        del env["CNI_NETNS"]
    else:
        env["CNI_NETNS"] = netns
    assert run_client(stand_in(take(received)), env).returncode == 3
    assert received[0][2] is None


def test_a_namespace_the_plugin_cannot_open_is_not_forwarded(run_client, tmp_path):
    path = tmp_path / "cni.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen()
        listener.setblocking(False)
        env = {**ADD_ENV, "CNI_NETNS": str(tmp_path / "gone")}
        done = run_client(path, env)
        with pytest.raises(BlockingIOError):
            listener.accept()
    assert (done.returncode, done.stdout) == plugin.execute(env, CONF)
    assert json.loads(done.stdout)["code"] == Code.UNKNOWN_CONTAINER


def test_a_fifo_as_cni_netns_does_not_hold_the_client(run_client, stand_in, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    received: Received = []
    done = run_client(stand_in(take(received)), {**ADD_ENV, "CNI_NETNS": str(fifo)})
    assert done.returncode == 3
    assert received[0][2] == os.stat(fifo).st_ino


def test_a_served_call_never_starts_the_python_plugin(run_client, stand_in, tmp_path):
    marker = tmp_path / "started"
    in_process = f"#!/bin/sh\ntouch {marker}\nexit 9\n"
    for verb in ("ADD", "CHECK", "DEL"):
        done = run_client(
            stand_in(take([])), {**ADD_ENV, "CNI_COMMAND": verb}, in_process=in_process
        )
        assert done.returncode == 3
    assert not marker.exists()
    done = run_client(None, {"CNI_COMMAND": "VERSION"}, in_process=in_process)
    assert done.returncode == 9 and marker.exists(), "VERSION runs in the Python plugin"


def test_a_declined_call_runs_in_process_with_the_same_stdin(run_client, stand_in):
    path = stand_in(take([], code=DECLINED))
    env = {k: v for k, v in ADD_ENV.items() if k != "CNI_IFNAME"}
    stdin = b'{"cniVersion": "0.4.0", "name": "n", "type": "knit"}'
    done = run_client(path, env, stdin=stdin)
    assert (done.returncode, done.stdout) == plugin.execute(env, stdin)
    assert json.loads(done.stdout)["cniVersion"] == "0.4.0"


def test_a_daemon_gone_before_answering_gives_the_error_json(run_client, stand_in):
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


def test_an_unreachable_daemon_is_named_in_the_calls_version(run_client, tmp_path):
    (tmp_path / "file").write_text("")
    unreachable = tmp_path / "file" / "cni.sock"
    done = run_client(unreachable, ADD_ENV, stdin=b'{"cniVersion": "0.4.0", "name": "n"}')
    assert done.returncode == 1
    error = json.loads(done.stdout)
    assert error["cniVersion"] == "0.4.0"
    assert error["msg"] == f"cannot reach the knit daemon at {unreachable}: Not a directory"


def test_a_half_answer_is_not_taken_for_an_answer(run_client, stand_in):
    def half(connection: socket.socket) -> None:
        read_request(connection).close()
        connection.sendall(encode_response(0, b'{"cniVersion": "1.1.0"}\n')[:-5])

    done = run_client(stand_in(half), ADD_ENV)
    assert done.returncode == 1 and json.loads(done.stdout)["code"] == 199


def test_a_daemon_of_another_protocol_is_named(run_client, stand_in):
    def newer(connection: socket.socket) -> None:
        connection.recv(1 << 16)
        connection.sendall(bytes((PROTOCOL + 1, 0)) + b"\0\0\0\0")

    done = run_client(stand_in(newer), ADD_ENV)
    assert done.returncode == 1
    assert json.loads(done.stdout) == {
        "cniVersion": "1.0.0",
        "code": 199,
        "msg": (f"the knit daemon speaks protocol {PROTOCOL + 1}, this plugin speaks {PROTOCOL}"),
    }


def hung_up(connection: socket.socket, wait: float) -> bool:
    """Whether the plugin hangs up on connection within wait seconds."""
    poller = select.poll()
    poller.register(connection, 0)  # POLLHUP is always reported
    return any(events & select.POLLHUP for _, events in poller.poll(wait * 1000))


def test_a_daemon_not_accepting_is_passed_over_at_the_connect_deadline(run_client, tmp_path):
    """A connect waits only on a full backlog; nothing was sent, so the call runs in-process."""
    path = tmp_path / "cni.sock"
    env = {k: v for k, v in ADD_ENV.items() if k != "CNI_IFNAME"}
    with socket.socket(socket.AF_UNIX) as listener, socket.socket(socket.AF_UNIX) as waiting:
        listener.bind(str(path))
        listener.listen(0)
        waiting.connect(str(path))  # the one connection a backlog of 0 holds
        started = time.monotonic()
        done = run_client(path, env)
        took = time.monotonic() - started
    assert (done.returncode, done.stdout) == plugin.execute(env, CONF)
    assert 1 <= took < 1 + 5, "the connect deadline is 1 s; the rest is the plugin's start"


def test_a_call_the_daemon_never_reads_runs_in_process_after_a_hang_up(run_client, stand_in):
    """A daemon that accepted and then stopped: at the pickup deadline the plugin hangs up,
    and only then, finding its request unread, runs the call itself. A daemon waking later
    finds the hang-up before the request (cni.server does not run it)."""
    seen: queue.Queue[tuple[bool, bytes]] = queue.Queue()
    client_gone = threading.Event()

    def stopped(connection: socket.socket) -> None:
        client_gone.wait(30)  # the daemon wakes only then
        seen.put((hung_up(connection, 0), receive_all(connection)))

    env = {k: v for k, v in ADD_ENV.items() if k != "CNI_IFNAME"}
    started = time.monotonic()
    done = run_client(stand_in(stopped), env)
    took = time.monotonic() - started
    client_gone.set()
    assert (done.returncode, done.stdout) == plugin.execute(env, CONF)
    assert 2 <= took < 2 + 5, "the pickup deadline is 2 s; the rest is the plugin's start"
    given_up, request = seen.get(timeout=10)
    assert given_up and request[1:] == encode_request(env, CONF)[1:], "whole, yet given up"


def test_a_call_the_daemon_took_and_never_answered_fails_at_the_answer_deadline(tmp_path, stand_in):
    """The daemon read the call and may be running it: it is not redone (error 199, which the
    runtime retries). Built with a 1 s answer deadline for the test."""
    executable = tmp_path / "quick" / "knit"
    executable.parent.mkdir()
    source = ROOT / "cni" / "client.c"
    flags = ["-O2", "-static", "-Wall", "-Wextra", "-Werror", "-DANSWER_DEADLINE_MS=1000"]
    subprocess.run(["cc", *flags, "-o", str(executable), str(source)], check=True)

    def taken(connection: socket.socket) -> None:
        read_request(connection).close()
        hung_up(connection, 10)  # until the plugin leaves

    client_path = set_up_client(tmp_path / "bin", executable, stand_in(taken))
    started = time.monotonic()
    done = call_plugin(client_path, ADD_ENV, CONF)
    assert time.monotonic() - started < 1 + 5
    assert done.returncode == 1
    assert json.loads(done.stdout) == {
        "cniVersion": "1.0.0",
        "code": 199,
        "msg": "the knit daemon did not answer in 1 s: the call may have run, not redone",
    }, "not the in-process answer (code 3: CNI_NETNS is a file), so not redone"


@pytest.mark.parametrize("situation", ["no socket file", "nobody listening", "no socket named"])
def test_the_call_runs_in_process_without_a_daemon(run_client, tmp_path, situation):
    path = tmp_path / "cni.sock"
    if situation == "nobody listening":
        bound = socket.socket(socket.AF_UNIX)
        bound.bind(str(path))
    env = {k: v for k, v in ADD_ENV.items() if k != "CNI_IFNAME"}
    done = run_client(None if situation == "no socket named" else path, env)
    assert (done.returncode, done.stdout) == plugin.execute(env, CONF)
    assert json.loads(done.stdout)["code"] == 4


def test_a_client_without_its_launch_file_says_so(compiled, tmp_path):
    done = subprocess.run([str(compiled)], env={"CNI_COMMAND": "VERSION"}, capture_output=True)
    assert done.returncode == 1
    assert done.stderr.decode() == f"knit: cannot read knit.d/launch beside {compiled}\n"


def python_plugin(env: dict[str, str], prelude: str = "") -> subprocess.CompletedProcess[bytes]:
    """cni.in_process.main as the in-process launcher runs it."""
    code = (
        f"import sys; sys.path[:0] = [{str(ROOT)!r}]; {prelude}"
        "from cni.in_process import main; main()"
    )
    return subprocess.run(
        [sys.executable, "-I", "-S", "-c", code], env=env, input=CONF, capture_output=True
    )


def test_ld_library_path_stays_out_of_what_the_python_plugin_runs():
    """The bundle's launcher sets it for the interpreter alone: iptables and a delegated
    plugin must not inherit it."""
    show = (
        "import cni.plugin, os, subprocess; "
        "cni.plugin.main = lambda: print(os.environ.get('LD_LIBRARY_PATH'), "
        "subprocess.run(['env'], capture_output=True, text=True).stdout.count('LD_LIBRARY'), "
        "end=''); "
    )
    done = python_plugin({"CNI_COMMAND": "VERSION", "LD_LIBRARY_PATH": "/bundle"}, show)
    assert done.stdout == b"None 0"


def test_the_clients_error_is_printed_as_the_calls_error_json():
    done = python_plugin({"CNI_COMMAND": "ADD", in_process.ERROR_VARIABLE: "went wrong"})
    assert done.returncode == 1
    assert done.stdout == plugin.error_output(CniError(Code.UNEXPECTED, "went wrong"), CONF)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "run" / "knit" / "cni.sock"
    served = serve(str(path))
    yield path
    served.close()


def exchange(path: Path, request: bytes, netns_fd: int | None = None) -> bytes:
    with socket.socket(socket.AF_UNIX) as connection:
        connection.connect(str(path))
        send_request(connection, request, netns_fd)
        return receive_all(connection)


def call(
    path: Path, environ: dict[str, str], stdin: bytes, netns: str | None = None
) -> tuple[int, bytes]:
    """A call as the plugin makes it, with a descriptor of netns (by default CNI_NETNS)."""
    netns = environ.get("CNI_NETNS") if netns is None else netns
    netns_fd = os.open(netns, os.O_RDONLY) if netns else None
    try:
        answer = exchange(path, encode_request(environ, stdin), netns_fd)
    finally:
        if netns_fd is not None:
            os.close(netns_fd)
    return decode_response(answer)


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
    answer = exchange(server, bytes((PROTOCOL + 1,)) + b"\0" * 8)
    assert answer[0] == PROTOCOL and answer[1] == 1
    assert json.loads(answer[6:])["msg"] == (
        f"the plugin speaks protocol {PROTOCOL + 1}, this knit daemon speaks {PROTOCOL}"
    )


def test_the_socket_is_private_and_removed_on_close(tmp_path):
    path = tmp_path / "run" / "knit" / "cni.sock"
    served = serve(str(path))
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    served.close()
    assert not path.exists()


def test_a_folder_made_before_is_made_private(tmp_path):
    """A hostPath DirectoryOrCreate makes the folder 0755 before the daemon starts."""
    path = tmp_path / "run" / "knit" / "cni.sock"
    path.parent.mkdir(parents=True, mode=0o755)
    served = serve(str(path))
    try:
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    finally:
        served.close()


# Connects as uid 65534 and sends an ADD (refused with code 4 wherever it runs), then prints
# the answer's hex: the socket is left open to it, to show the daemon's own check.
AS_NOBODY = """
import os, socket, sys
os.setgroups([]); os.setgid(65534); os.setuid(65534)
connection = socket.socket(socket.AF_UNIX)
connection.settimeout(10)
connection.connect(sys.argv[1])
try:
    connection.sendall(bytes.fromhex(sys.argv[2]))
    connection.shutdown(socket.SHUT_WR)
except OSError:
    pass
answer = b""
try:
    while chunk := connection.recv(65536):
        answer += chunk
except ConnectionResetError:
    pass
print(answer.hex())
"""


def test_a_peer_that_is_not_root_is_refused(caplog):
    """The socket's modes keep others out; the daemon checks its peer's uid besides (a uid
    mapped from a user namespace is seen as its uid outside)."""
    folder = Path(tempfile.mkdtemp(prefix="knit-peer-"))
    try:
        path = folder / "run" / "cni.sock"
        served = serve(str(path))
        for opened in (folder, path.parent):
            opened.chmod(0o711)
        path.chmod(0o666)
        env = {k: v for k, v in ADD_ENV.items() if k != "CNI_NETNS"}
        request = encode_request(env, CONF).hex()
        done = subprocess.run(
            [sys.executable, "-I", "-S", "-c", AS_NOBODY, str(path), request],
            capture_output=True,
            timeout=30,
            check=True,
        )
        served.close()
    finally:
        shutil.rmtree(folder)
    code, output = decode_response(bytes.fromhex(done.stdout.decode()))
    assert code == 1
    assert json.loads(output)["msg"] == "the knit daemon serves only root (uid 0), not uid 65534"
    assert served.calls == 0
    assert "refused a call from uid 65534" in caplog.text


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


def test_a_delegated_plugin_sees_only_the_calls_spec_variables_and_a_minimal_path(
    tmp_path, monkeypatch
):
    """The daemon's environment (a token, its own CNI_*) and a variable the spec does not
    define stay out of what the plugin sees, on either path."""
    seen = tmp_path / "seen"
    script = tmp_path / "show-env"
    script.write_text(f"#!/bin/sh\nexec /usr/bin/env > {seen}\n")
    script.chmod(0o755)
    monkeypatch.setenv("CNI_CONTAINERID", "the-daemons-own")
    monkeypatch.setenv("KNIT_DAEMON_TOKEN", "secret")
    env = {**ADD_ENV, "CNI_PATH": str(tmp_path), "CNI_ARGS": "IgnoreUnknown=1", "CNI_X": "y"}
    Delegate("show-env", b"{}", from_environ(env)).release("c1", "eth0")
    variables = dict(line.split("=", 1) for line in seen.read_text().splitlines())
    variables.pop("PWD")  # the shell's own
    expected = {k: v for k, v in env.items() if k != "CNI_X"}
    assert variables == {**expected, "CNI_COMMAND": "DEL", "PATH": MINIMAL_PATH}


def test_a_delegated_plugin_past_its_deadline_is_killed_with_its_children(tmp_path, monkeypatch):
    """An ADD that hangs is killed (with what it started), and given back with a DEL, as it
    may have reserved an address before it hung."""
    monkeypatch.setattr(delegate, "DEADLINE", 0.5)
    calls = tmp_path / "calls"
    script = tmp_path / "hanging-ipam"
    script.write_text(
        f'#!/bin/sh\necho "$CNI_COMMAND $$" >> {calls}\n[ "$CNI_COMMAND" = DEL ] && exit 0\n'
        f'sleep 60 &\necho "child $!" >> {calls}\nwait\n'
    )
    script.chmod(0o755)
    invocation = from_environ({**ADD_ENV, "CNI_PATH": str(tmp_path)})
    started = time.monotonic()
    with pytest.raises(CniError) as err:
        Delegate("hanging-ipam", b"{}", invocation).add("c1", "eth0")
    assert time.monotonic() - started < 5
    assert err.value.code == Code.DELEGATE_FAILURE
    assert err.value.msg == "IPAM plugin hanging-ipam ADD did not answer in 0.5 s: killed"
    recorded = [line.split() for line in calls.read_text().splitlines()]
    assert [verb for verb, _ in recorded] == ["ADD", "child", "DEL"]
    for _, pid in recorded[:2]:
        assert not running(int(pid)), f"{pid} was killed"


def test_a_call_deadline_cuts_a_delegated_call_short_but_never_a_del(tmp_path, monkeypatch):
    """The daemon's deadline for the whole call (cni.invocation.call_deadline) bounds its
    delegated calls; a DEL, which gives back what the pod or a failed ADD holds, gets its own."""
    script = tmp_path / "slow-ipam"
    script.write_text("#!/bin/sh\nsleep 1\n")
    script.chmod(0o755)
    invocation = from_environ({**ADD_ENV, "CNI_PATH": str(tmp_path)})
    token = call_deadline.set(time.monotonic() + 0.3)
    try:
        with pytest.raises(CniError) as err:
            Delegate("slow-ipam", b"{}", invocation).check("c1", "eth0")
        assert err.value.msg.startswith("IPAM plugin slow-ipam CHECK did not answer in 0.")
        Delegate("slow-ipam", b"{}", invocation).release("c1", "eth0")
    finally:
        call_deadline.reset(token)


def running(pid: int) -> bool:
    """Whether pid is a process that is not a zombie (an orphan may wait for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


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
