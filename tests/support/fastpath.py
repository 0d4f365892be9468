"""The CNI fast path from the tests' side: the wire format as the daemon expects it (the
compiled client, cni/client.c, speaks it too), and that client set up in a directory of its
own, with its knit.d/launch naming an in-process plugin and a socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import sysconfig
from pathlib import Path

from cni.server import LENGTH_BYTES, PROTOCOL
from deploy.lab.paths import ROOT

HEADER_BYTES = 2 + LENGTH_BYTES
# The Python plugin as the Makefile's build/cni/knit.d/knit-in-process runs it.
IN_PROCESS = (
    f"#!{sys.executable} -IS\n"
    f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {sysconfig.get_paths()['purelib']!r}]\n"
    "from cni.in_process import main\nmain()\n"
)


def compile_client(directory: Path) -> Path:
    """The client as `make cni` and the Dockerfile build it: directory/cni/knit."""
    target = directory / "cni" / "knit"
    subprocess.run(
        ["make", "-s", "-C", str(ROOT), f"BUILD={directory}", str(target)],
        check=True,
        capture_output=True,
    )
    return target


def set_up_client(
    directory: Path, client: Path, socket_path: Path | None, in_process: str = IN_PROCESS
) -> Path:
    """directory/knit: the client, with its launch file and the in-process plugin script."""
    (directory / "knit.d").mkdir(parents=True, exist_ok=True)
    executable = directory / "knit"
    executable.write_bytes(client.read_bytes())
    executable.chmod(0o755)
    script = directory / "knit.d" / "knit-in-process"
    script.write_text(in_process)
    script.chmod(0o755)
    launch = f"plugin=knit.d/knit-in-process\nsocket={socket_path or ''}\n"
    (directory / "knit.d" / "launch").write_text(launch)
    return executable


def call_plugin(
    executable: Path, env: dict[str, str], stdin: bytes
) -> subprocess.CompletedProcess[bytes]:
    """The plugin executable called as a runtime calls it: env and PATH, stdin, output kept."""
    return subprocess.run(
        [str(executable)],
        input=stdin,
        env={"PATH": os.environ["PATH"], **env},
        capture_output=True,
        timeout=30,
    )


def encode_request(environ: dict[str, str], stdin: bytes) -> bytes:
    env = b"\0".join(f"{k}={v}".encode() for k, v in environ.items())
    return b"".join((bytes((PROTOCOL,)), _length(env), env, _length(stdin), stdin))


def send_request(connection: socket.socket, request: bytes, netns_fd: int | None) -> None:
    """As the client sends it: the version byte alone, with the descriptor."""
    rights = []
    if netns_fd is not None:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, netns_fd.to_bytes(4, sys.byteorder))]
    connection.sendmsg([request[:1]], rights)
    connection.sendall(request[1:])
    connection.shutdown(socket.SHUT_WR)


def receive_all(connection: socket.socket) -> bytes:
    """The answer as the client reads it: up to the end, or a reset (the daemon closing on
    what it did not read)."""
    chunks = []
    try:
        while chunk := connection.recv(1 << 16):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def decode_response(answer: bytes) -> tuple[int, bytes]:
    """(exit code, output) of a whole answer in this protocol."""
    assert answer[0] == PROTOCOL, answer
    size = int.from_bytes(answer[2:HEADER_BYTES], "big")
    assert len(answer) == HEADER_BYTES + size, answer
    return answer[1], answer[HEADER_BYTES:]


def _length(data: bytes) -> bytes:
    return len(data).to_bytes(LENGTH_BYTES, "big")
