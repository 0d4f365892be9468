"""The node daemon's side of the CNI fast path: serves the calls cni.client hands over.

Each connection carries one call (the wire format is in cni.client) and runs in its own
thread, through cni.plugin.execute: the same code as the in-process path, with the call's
forwarded CNI_* variables in place of the process environment and the namespace the plugin
opened in place of CNI_NETNS, which this daemon's mount and PID namespaces may not resolve.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from cni import client
from cni.errors import CniError, Code
from cni.plugin import error_output, execute

log = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0
CLOSE_WAIT = 5.0
MAX_ENV_BYTES = 1 << 20
MAX_STDIN_BYTES = 1 << 26
BACKLOG = 128
SERVED = frozenset(verb.decode() for verb in client.FORWARDED)
LAZY_MODULES = ("cni.bridge", "cni.masq", "cni.spoofcheck", "cni.ipam.hostlocal")


class ProtocolError(Exception):
    """A request this daemon cannot read; answered with an error, never executed."""


@dataclass(frozen=True)
class Request:
    environ: dict[str, str]
    stdin: bytes
    netns_fd: int | None  # the plugin's descriptor of CNI_NETNS, closed after the call

    def close(self) -> None:
        if self.netns_fd is not None:
            os.close(self.netns_fd)


class CniServer:
    """Accepts calls on a listening unix socket until close()."""

    def __init__(self, listener: socket.socket, path: str) -> None:
        self.path = path
        self.calls = 0
        self._listener = listener
        self._inode = os.stat(path).st_ino
        self._lock = threading.Lock()
        self._in_flight: set[threading.Thread] = set()
        self._closing = threading.Event()
        self._acceptor = threading.Thread(target=self._accept, name="cni-server", daemon=True)
        self._acceptor.start()

    def close(self) -> None:
        """Stop accepting, remove the socket file, and give calls in flight a moment."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._acceptor.join(CLOSE_WAIT)
        try:
            if os.stat(self.path).st_ino == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        deadline = time.monotonic() + CLOSE_WAIT
        with self._lock:
            in_flight = list(self._in_flight)
        for thread in in_flight:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError as err:
                if self._closing.is_set():
                    return
                log.warning("CNI server: accept failed: %s", err)
                time.sleep(0.1)
                continue
            thread = threading.Thread(target=self._serve, args=(connection,), daemon=True)
            with self._lock:
                self._in_flight.add(thread)
            thread.start()

    def _serve(self, connection: socket.socket) -> None:
        start = time.monotonic()
        try:
            with connection:
                connection.settimeout(REQUEST_TIMEOUT)
                try:
                    request = read_request(connection)
                except ProtocolError as err:
                    log.warning("CNI server: refused a call: %s", err)
                    connection.sendall(encode_response(1, error_json(str(err), b"")))
                    _drain(connection)
                    return
                try:
                    code, output = self._execute(request)
                finally:
                    request.close()
                connection.sendall(encode_response(code, output))
            log.info(
                "CNI %s %s/%s: exit %d in %.1f ms",
                request.environ.get("CNI_COMMAND"),
                request.environ.get("CNI_CONTAINERID"),
                request.environ.get("CNI_IFNAME"),
                code,
                (time.monotonic() - start) * 1000,
            )
        except OSError as err:
            log.warning("CNI server: call dropped: %s", err)
        finally:
            with self._lock:
                self._in_flight.discard(threading.current_thread())

    def _execute(self, request: Request) -> tuple[int, bytes]:
        command = request.environ.get("CNI_COMMAND", "")
        if command not in SERVED:
            verbs = ", ".join(sorted(SERVED))
            return 1, error_json(f"the knit daemon serves {verbs}, not {command!r}", request.stdin)
        with self._lock:
            self.calls += 1
        return execute(request.environ, request.stdin, request.netns_fd)


def serve(socket_path: str) -> CniServer:
    """Listen on socket_path (0600, in a directory made 0700 if new) and serve calls."""
    _warm_up()
    path = Path(socket_path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise FileExistsError(f"{path} exists and is not a socket")
    except FileNotFoundError:
        pass
    # Bound and restricted under a temporary name, then renamed over a stale socket: a
    # client never finds the path missing or the socket open to others.
    staging = f"{path}.{os.getpid()}"
    Path(staging).unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(staging)
        os.chmod(staging, 0o600)
        listener.listen(BACKLOG)
        os.rename(staging, path)
    except BaseException:
        listener.close()
        Path(staging).unlink(missing_ok=True)
        raise
    return CniServer(listener, str(path))


def _warm_up() -> None:
    """Import what the verbs import lazily, so that no call pays for it."""
    for name in LAZY_MODULES:
        importlib.import_module(name)


def read_request(connection: socket.socket) -> Request:
    """The call, with the namespace descriptor that came with its version byte, if any; a
    request refused here leaves no descriptor open."""
    version, fds, _, _ = socket.recv_fds(connection, 1, 1, socket.MSG_CMSG_CLOEXEC)
    netns_fd = fds[0] if fds else None
    try:
        environ, stdin = _read_call(connection, version)
        _check_netns(environ.get("CNI_NETNS", ""), netns_fd)
    except BaseException:
        if netns_fd is not None:
            os.close(netns_fd)
        raise
    return Request(environ, stdin, netns_fd)


def _check_netns(path: str, netns_fd: int | None) -> None:
    if path and netns_fd is None:
        raise ProtocolError(f"the plugin named CNI_NETNS {path} without passing its descriptor")
    if netns_fd is not None and not path:
        raise ProtocolError("the plugin passed a namespace descriptor without CNI_NETNS")


def _read_call(connection: socket.socket, version: bytes) -> tuple[dict[str, str], bytes]:
    if not version:
        raise ProtocolError("the plugin closed the connection before sending its call")
    if version[0] != client.PROTOCOL:
        raise ProtocolError(
            f"the plugin speaks protocol {version[0]}, this knit daemon speaks {client.PROTOCOL}"
        )
    env = _receive_exactly(connection, _receive_length(connection, MAX_ENV_BYTES))
    stdin = _receive_exactly(connection, _receive_length(connection, MAX_STDIN_BYTES))
    environ = {}
    for entry in filter(None, env.split(b"\0")):
        key, _, value = entry.partition(b"=")
        environ[os.fsdecode(key)] = os.fsdecode(value)
    return environ, stdin


def encode_response(code: int, output: bytes) -> bytes:
    return (
        bytes((client.PROTOCOL, code)) + len(output).to_bytes(client.LENGTH_BYTES, "big") + output
    )


def error_json(msg: str, stdin: bytes) -> bytes:
    """Error 199 in the call's cniVersion; a request that could not be read has none."""
    return error_output(CniError(Code.UNEXPECTED, msg), stdin)


def _receive_length(connection: socket.socket, limit: int) -> int:
    size = int.from_bytes(_receive_exactly(connection, client.LENGTH_BYTES), "big")
    if size > limit:
        raise ProtocolError(f"a request field of {size} bytes is over the limit of {limit}")
    return size


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = connection.recv(min(size - len(data), 1 << 16))
        if not chunk:
            raise ProtocolError("the plugin closed the connection before sending its call")
        data += chunk
    return bytes(data)


def _drain(connection: socket.socket) -> None:
    """Read what the plugin still sends: closing on unread data would reset the connection
    and lose the answer."""
    connection.shutdown(socket.SHUT_WR)
    while connection.recv(1 << 16):
        pass
