"""The fast path's daemon (cni.server) under clients that are stuck, slow, too many or too big:
none of them holds a thread past the request deadline or keeps a real call from being run."""

from __future__ import annotations

import json
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from cni import plugin
from cni.server import (
    DECLINED,
    MAX_ENV_BYTES,
    MAX_STDIN_BYTES,
    PROTOCOL,
    REQUEST_DEADLINE,
    CniServer,
    Limits,
    serve,
)
from deploy.lab.process import eventually
from tests.support.fastpath import (
    HEADER_BYTES,
    call_plugin,
    compile_client,
    decode_response,
    encode_request,
    receive_all,
    send_request,
    set_up_client,
)

# An ADD without CNI_NETNS: both paths refuse it (code 4) at once, with no namespace to open.
ENV = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "eth0"}
CONF = b'{"cniVersion": "1.0.0", "name": "n", "type": "knit"}'
SLACK = 1.0  # for a loaded machine: what a check may take beyond the time it is about

Start = Callable[..., tuple[Path, CniServer]]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Start]:
    """serve() on a socket in tmp_path, with the limits given; closed after the test."""
    servers: list[CniServer] = []

    def started(limits: Limits | None = None) -> tuple[Path, CniServer]:
        path = tmp_path / f"cni-{len(servers)}.sock"
        servers.append(serve(str(path), limits))
        return path, servers[-1]

    yield started
    for server in servers:
        server.close()


def connect(path: Path) -> socket.socket:
    connection = socket.socket(socket.AF_UNIX)
    connection.settimeout(10)  # a test that would hang fails instead
    connection.connect(str(path))
    return connection


def call(path: Path, environ: dict[str, str], stdin: bytes) -> tuple[int, bytes]:
    """A call as the plugin makes it: the whole request, then the answer."""
    with connect(path) as connection:
        send_request(connection, encode_request(environ, stdin), None)
        return decode_response(receive_all(connection))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_client(tmp_path_factory.mktemp("client"))


@pytest.fixture
def run_plugin(compiled: Path, tmp_path: Path) -> Callable[..., subprocess.CompletedProcess[bytes]]:
    """The `knit` executable, its daemon's socket being path."""

    def run(path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
        return call_plugin(set_up_client(tmp_path / "bin", compiled, path), env, CONF)

    return run


def declined(answer: bytes) -> str:
    """The reason a DECLINED answer gives, which plugins before DECLINED print."""
    code, output = decode_response(answer)
    assert code == DECLINED, answer
    msg: str = json.loads(output)["msg"]
    return msg


def test_a_trickling_plugin_is_cut_off_at_the_deadline_while_a_call_is_served(start):
    """One byte a second resets no timeout: the request has REQUEST_DEADLINE from accept."""
    path, server = start()
    trickled: list[float | None] = []
    answers: list[bytes] = []

    def trickle() -> None:
        with connect(path) as connection:
            accepted = time.monotonic()
            connection.sendall(bytes((PROTOCOL,)) + (100).to_bytes(4, "big"))
            # 100 bytes of environment, one a second, until the daemon answers and closes
            while not select.select([connection], [], [], 1.0)[0]:
                if time.monotonic() - accepted > REQUEST_DEADLINE + 3 * SLACK:
                    trickled.append(None)
                    return
                try:
                    connection.send(b"x")
                except (BrokenPipeError, ConnectionResetError):
                    break  # the daemon answered and closed between the look and the send
            trickled.append(time.monotonic() - accepted)
            answers.append(receive_all(connection))

    trickler = threading.Thread(target=trickle)
    trickler.start()
    time.sleep(1.2)  # the trickler is past its first byte of environment
    asked = time.monotonic()
    assert call(path, ENV, CONF) == plugin.execute(ENV, CONF)
    assert time.monotonic() - asked < SLACK, "a call is answered while another trickles"
    trickler.join()
    assert trickled[0] is not None, "the daemon still reads from the trickler"
    assert REQUEST_DEADLINE - 0.1 < trickled[0] < REQUEST_DEADLINE + SLACK
    assert declined(answers[0]) == f"the plugin sent no whole call in {REQUEST_DEADLINE:g} s"
    assert (server.calls, server.declined) == (1, 1)


def test_idle_connections_hold_no_more_threads_than_the_cap_and_calls_still_run(start, run_plugin):
    cap = 4
    path, server = start(Limits(calls=cap, request_deadline=60.0, admission_wait=0.5))
    baseline = threading.active_count()
    opened = time.monotonic()
    idle = [connect(path) for _ in range(3 * cap)]
    try:
        eventually(lambda: server.declined == 2 * cap, 5, "the connections over the cap declined")
        # One wait (admission_wait) for the flood, not one per connection over the cap (4 s).
        assert time.monotonic() - opened < 0.5 + SLACK
        assert threading.active_count() <= baseline + cap
        busy = f"the knit daemon is serving {cap} calls, its limit"
        assert [declined(receive_all(connection)) for connection in idle[cap:]] == [busy] * 2 * cap
        # A real call meanwhile: declined too, so the plugin runs it in-process.
        done = run_plugin(path, ENV)
        assert (done.returncode, done.stdout) == plugin.execute(ENV, CONF)
        assert (server.calls, server.declined) == (0, 2 * cap + 1)
        assert threading.active_count() <= baseline + cap
    finally:
        for connection in idle:
            connection.close()
    # The idle connections gone, their threads end and the daemon serves again.
    eventually(lambda: threading.active_count() == baseline, 5, "the idle connections' threads end")
    done = run_plugin(path, ENV)
    assert (done.returncode, done.stdout) == plugin.execute(ENV, CONF)
    assert (server.calls, server.declined) == (1, 2 * cap + 1)


def test_a_call_waits_briefly_for_a_slot_that_frees(start):
    path, server = start(Limits(calls=1, request_deadline=60.0, admission_wait=2.0))
    baseline = threading.active_count()
    holder = connect(path)
    eventually(lambda: threading.active_count() > baseline, 5, "an idle connection holds the slot")
    answers: list[tuple[int, bytes]] = []
    caller = threading.Thread(target=lambda: answers.append(call(path, ENV, CONF)))
    caller.start()
    time.sleep(0.3)
    holder.close()
    caller.join()
    assert answers == [plugin.execute(ENV, CONF)]
    assert (server.calls, server.declined) == (1, 0)


def test_an_oversize_request_is_refused_with_an_error(start):
    path, server = start()
    too_big = b" " * (MAX_STDIN_BYTES + 1)
    code, output = call(path, ENV, too_big)
    assert code == 1
    assert json.loads(output)["msg"] == (
        f"the call's stdin of {MAX_STDIN_BYTES + 1} bytes is over the limit of {MAX_STDIN_BYTES}"
    )
    assert server.calls == 0


def test_an_oversize_length_alone_is_answered_and_the_connection_ended(start):
    """A plugin that names a field too big and then sends nothing: its error comes at once,
    and the daemon stops reading from it at the deadline."""
    deadline = 1.0
    path, server = start(Limits(request_deadline=deadline))
    baseline = threading.active_count()
    with connect(path) as connection:
        sent = time.monotonic()
        connection.sendall(bytes((PROTOCOL,)) + (MAX_ENV_BYTES + 1).to_bytes(4, "big"))
        header = connection.recv(HEADER_BYTES)
        assert time.monotonic() - sent < SLACK
        size = int.from_bytes(header[2:], "big")
        code, output = decode_response(header + receive_all(connection))
        # Still connected, and still sending nothing: the daemon's thread ends all the same.
        eventually(lambda: threading.active_count() == baseline, deadline + SLACK, "thread ends")
    assert code == 1 and len(output) == size
    assert json.loads(output)["msg"] == (
        f"the call's environment of {MAX_ENV_BYTES + 1} bytes is over the limit of {MAX_ENV_BYTES}"
    )
    assert server.calls == 0
