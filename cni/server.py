"""The node daemon's side of the CNI fast path: serves the calls the executable `knit`
(cni/client.c) hands over.

Each connection carries one call (the wire format is in cni/client.c) and runs in its own
thread, through cni.plugin.execute: the same code as the in-process path, with the call's
forwarded CNI_* variables in place of the process environment and the namespace the plugin
opened in place of CNI_NETNS, which this daemon's mount and PID namespaces may not resolve.

The socket is 0600 in a 0700 folder, and a peer whose uid is not 0 is refused: a call runs
with the daemon's capabilities.

A stuck or slow plugin must never hold up a real call, so connections are bounded (Limits):
at most `calls` are served at once, each must deliver its whole request within
`request_deadline` of being accepted, and a request's fields have byte caps. A connection over
the first two limits is declined (DECLINED): the plugin then runs the call in-process,
as it would without a daemon. An oversize request is refused with an error. A request whose
plugin hung up before it was read whole is not run: the plugin runs it itself (its pickup
deadline, cni/client.c).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import select
import socket
import stat
import struct
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from cni.errors import CniError, Code
from cni.invocation import attaching, call_deadline
from cni.paths import narrowed_search_path
from cni.plugin import error_output, execute

log = logging.getLogger(__name__)

# The wire format's constants; cni/client.c defines the same (a unit test compares them).
PROTOCOL = 2
DECLINED = 255  # never an exit code of cni.plugin.execute (0 or 1)
LENGTH_BYTES = 4
SERVED = frozenset({"ADD", "CHECK", "DEL"})

# Calls served at once, a thread each. Kubelet and containerd do not throttle CNI calls: at
# worst every pod of a node (kubelet's default max-pods is 110) has its ADD in flight while its
# previous sandbox's DEL runs, 220 calls. A call over the limit is declined, so runs in-process.
MAX_CALLS = 256
# From accept to the whole request read. The plugin sends its call at once, so even
# MAX_STDIN_BYTES arrive long before this; a plugin this late is declined, so runs in-process:
# the deadline costs no call its success, and a stuck client holds a thread for 2 s at most.
REQUEST_DEADLINE = 2.0
# How long a connection that finds every slot taken waits for one before it is declined: a
# call in the daemon ends well within it, and running in-process costs about as much more than
# the fast path (docs/benchmarks.md#plain), so a longer wait could cost more than declining
# does.
ADMISSION_WAIT = 0.1
# From the whole request read to the call's end, for what a call waits on outside the kernel:
# its delegated IPAM plugin is killed when this comes before the plugin's own deadline (a DEL,
# which gives back what a pod or a failed ADD holds, always gets the plugin's 20 s). With that
# DEL, a call ends within 80 s, before the executable's answer deadline (90 s, cni/client.c).
CALL_DEADLINE = 60.0
# For sending an answer; a few KB, which the socket's buffer takes at once.
ANSWER_TIMEOUT = 2.0
CLOSE_WAIT = 5.0
# A request's byte caps. The forwarded CNI_* variables are a few short strings (the kernel caps
# one at 128 KiB); stdin is the network config with prevResult and runtimeConfig, a few KB.
MAX_ENV_BYTES = 1 << 18
MAX_STDIN_BYTES = 1 << 20
BACKLOG = 128
UCRED = struct.Struct("iII")  # struct ucred: pid, uid, gid
LAZY_MODULES = ("cni.bridge", "cni.masq", "cni.spoofcheck", "cni.ipam.hostlocal")


class ProtocolError(Exception):
    """A request this daemon cannot read; answered with an error, never executed."""


class DeadlineExceeded(Exception):
    """The plugin did not send its whole request in time; declined, never executed."""


@dataclass(frozen=True)
class Limits:
    """What one daemon serves at once and waits for (see the constants for the choices)."""

    calls: int = MAX_CALLS
    request_deadline: float = REQUEST_DEADLINE
    admission_wait: float = ADMISSION_WAIT


class SandboxHooks(Protocol):
    """What the daemon does around the calls it serves for a pod's sandbox."""

    def attaching(self, environ: Mapping[str, str], addresses: tuple[str, ...]) -> None:
        """An ADD gave the sandbox these addresses; called before its interface is attached
        (see cni.invocation.attaching)."""

    def deleted(self, environ: Mapping[str, str]) -> None:
        """A DEL succeeded."""


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

    def __init__(
        self,
        listener: socket.socket,
        path: str,
        limits: Limits | None = None,
        bin_dirs: Sequence[str] = (),
        hooks: SandboxHooks | None = None,
    ) -> None:
        self.path = path
        self.hooks = hooks
        self.limits = limits or Limits()
        self.bin_dirs = tuple(bin_dirs)
        self.calls = 0
        self.declined = 0
        self._listener = listener
        self._inode = os.stat(path).st_ino
        self._lock = threading.Lock()
        self._in_flight: set[threading.Thread] = set()
        self._slots = threading.BoundedSemaphore(self.limits.calls)
        self._full = False  # the last connection found no slot free: the next waits for none
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
            accepted = time.monotonic()
            if not self._from_root(connection):
                continue
            # Declining is safe: the executable runs a declined call in-process, as without a
            # daemon, so a connection over the limit costs its call the in-process start-up
            # (docs/benchmarks.md#plain), not its success.
            # (A connection closed without an answer would be an error 199 instead: once
            # connected, the client never redoes a call the daemon may have started.)
            if not self._admit():
                with connection:
                    busy = f"the knit daemon is serving {self.limits.calls} calls, its limit"
                    self._decline(connection, busy)
                continue
            thread = threading.Thread(target=self._serve, args=(connection, accepted), daemon=True)
            with self._lock:
                self._in_flight.add(thread)
            try:
                thread.start()
            except RuntimeError as err:  # no thread to be had: the call runs in-process
                with self._lock:
                    self._in_flight.discard(thread)
                self._slots.release()
                with connection:
                    self._decline(connection, f"the knit daemon cannot start a thread: {err}")

    def _from_root(self, connection: socket.socket) -> bool:
        """Whether the peer is root; any other is refused with an error and closed, before it
        takes a slot. The socket's modes keep others out already; this holds even when they
        are loosened, and for a root mapped from a user namespace (the kernel gives its uid
        outside). Refused, not declined: the caller is not the container runtime."""
        pid, uid = peer(connection)
        if uid == 0:
            return True
        log.warning("CNI server: refused a call from uid %d (pid %d): not root", uid, pid)
        with connection:
            refusal = f"the knit daemon serves only root (uid 0), not uid {uid}"
            try:
                connection.setblocking(False)  # a fresh socket's buffer takes the answer at once
                connection.sendall(encode_response(1, error_json(refusal, b"")))
            except OSError as err:
                log.warning("CNI server: could not answer uid %d: %s", uid, err)
        return False

    def _admit(self) -> bool:
        """Take a slot for the connection just accepted. When none is free, the connection
        waits admission_wait for one; until one frees, the connections after it are declined
        at once, so that a flood costs the acceptor one wait, not one per connection (the
        connections behind it in the backlog must not wait for each other's waits)."""
        if self._slots.acquire(blocking=False):
            self._full = False
            return True
        if self._full:
            return False
        self._full = not self._slots.acquire(timeout=self.limits.admission_wait)
        if self._full:
            log.warning(
                "CNI server: %d calls in flight: declining new ones until one ends",
                self.limits.calls,
            )
        return not self._full

    def _decline(self, connection: socket.socket, reason: str) -> None:
        """Answer that the call was not run, without waiting: the plugin runs it itself."""
        with self._lock:
            self.declined += 1
        try:
            connection.setblocking(False)  # a fresh socket's buffer takes the answer at once
            connection.sendall(encode_response(DECLINED, error_json(reason, b"")))
        except OSError as err:
            log.warning("CNI server: could not decline a call (%s): %s", reason, err)

    def _serve(self, connection: socket.socket, accepted: float) -> None:
        deadline = accepted + self.limits.request_deadline
        try:
            with connection:
                try:
                    request = read_request(connection, deadline)
                except DeadlineExceeded:
                    late = f"the plugin sent no whole call in {self.limits.request_deadline:g} s"
                    log.warning("CNI server: declined a call: %s", late)
                    self._decline(connection, late)
                    return
                except ProtocolError as err:
                    log.warning("CNI server: refused a call: %s", err)
                    connection.settimeout(ANSWER_TIMEOUT)
                    connection.sendall(encode_response(1, error_json(str(err), b"")))
                    _drain(connection, deadline)
                    return
                try:
                    if _given_up(connection):
                        log.warning(
                            "CNI server: the plugin gave up waiting for its %s: not run",
                            request.environ.get("CNI_COMMAND"),
                        )
                        return
                    code, output = self._execute(request)
                finally:
                    request.close()
                connection.settimeout(ANSWER_TIMEOUT)
                connection.sendall(encode_response(code, output))
            log.info(
                "CNI %s %s/%s: exit %d in %.1f ms",
                request.environ.get("CNI_COMMAND"),
                request.environ.get("CNI_CONTAINERID"),
                request.environ.get("CNI_IFNAME"),
                code,
                (time.monotonic() - accepted) * 1000,
            )
        except OSError as err:
            log.warning("CNI server: call dropped: %s", err)
        finally:
            with self._lock:
                self._in_flight.discard(threading.current_thread())
            self._slots.release()

    def _execute(self, request: Request) -> tuple[int, bytes]:
        command = request.environ.get("CNI_COMMAND", "")
        if command not in SERVED:
            verbs = ", ".join(sorted(SERVED))
            return 1, error_json(f"the knit daemon serves {verbs}, not {command!r}", request.stdin)
        with self._lock:
            self.calls += 1
        # The caller's CNI_PATH would have this daemon run a program of the caller's choice
        # with its capabilities (a delegated IPAM plugin): it may only narrow the daemon's own
        # bin dirs. (In-process, the runtime runs the plugin: CNI_PATH is the runtime's.)
        requested = request.environ.get("CNI_PATH", "")
        environ = {**request.environ, "CNI_PATH": narrowed_search_path(requested, self.bin_dirs)}
        # Each call has a thread of its own, so the deadline is this call's alone.
        call_deadline.set(time.monotonic() + CALL_DEADLINE)
        if self.hooks is not None and command == "ADD":
            attaching.set(functools.partial(self.hooks.attaching, environ))
        code, output = execute(environ, request.stdin, request.netns_fd)
        if self.hooks is not None and command == "DEL" and code == 0:
            self.hooks.deleted(environ)
        return code, output


def serve(
    socket_path: str,
    limits: Limits | None = None,
    bin_dirs: Sequence[str] = (),
    hooks: SandboxHooks | None = None,
) -> CniServer:
    """Listen on socket_path (0600, in a folder made 0700) and serve calls from root. A
    delegated IPAM plugin is run only from bin_dirs (none: no delegated plugin is run)."""
    _warm_up()
    listener, path = listen_private(socket_path)
    return CniServer(listener, path, limits, bin_dirs, hooks)


def listen_private(socket_path: str) -> tuple[socket.socket, str]:
    """A unix socket listening at socket_path, 0600 in a folder made 0700 (also serving the
    daemon's flow records, proxyd/policy/flow_server.py); and its path."""
    path = Path(socket_path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # mkdir's mode holds only for a folder it makes: the DaemonSet's hostPath
    # (DirectoryOrCreate) makes it 0755 before the daemon starts.
    os.chmod(path.parent, 0o700)
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
    return listener, str(path)


def peer(connection: socket.socket) -> tuple[int, int]:
    """The pid and uid of a unix socket's peer, as the kernel saw them when it connected."""
    ucred = connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size)
    pid, uid, _ = UCRED.unpack(ucred)
    return pid, uid


def _warm_up() -> None:
    """Import what the verbs import lazily, so that no call pays for it."""
    for name in LAZY_MODULES:
        importlib.import_module(name)


def read_request(connection: socket.socket, deadline: float | None = None) -> Request:
    """The call, with the namespace descriptor that came with its version byte, if any; a
    request refused here leaves no descriptor open. With a deadline (time.monotonic()), the
    whole request must have come by then, however it trickles in, else DeadlineExceeded."""
    _arm(connection, deadline)
    try:
        version, fds, _, _ = socket.recv_fds(connection, 1, 1, socket.MSG_CMSG_CLOEXEC)
    except TimeoutError as err:
        raise DeadlineExceeded from err
    netns_fd = fds[0] if fds else None
    try:
        environ, stdin = _read_call(connection, version, deadline)
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


def _read_call(
    connection: socket.socket, version: bytes, deadline: float | None
) -> tuple[dict[str, str], bytes]:
    if not version:
        raise ProtocolError("the plugin closed the connection before sending its call")
    if version[0] != PROTOCOL:
        raise ProtocolError(
            f"the plugin speaks protocol {version[0]}, this knit daemon speaks {PROTOCOL}"
        )
    env_size = _receive_length(connection, "environment", MAX_ENV_BYTES, deadline)
    env = _receive_exactly(connection, env_size, deadline)
    stdin_size = _receive_length(connection, "stdin", MAX_STDIN_BYTES, deadline)
    stdin = _receive_exactly(connection, stdin_size, deadline)
    environ = {}
    for entry in filter(None, env.split(b"\0")):
        key, _, value = entry.partition(b"=")
        environ[os.fsdecode(key)] = os.fsdecode(value)
    return environ, stdin


def encode_response(code: int, output: bytes) -> bytes:
    return bytes((PROTOCOL, code)) + len(output).to_bytes(LENGTH_BYTES, "big") + output


def error_json(msg: str, stdin: bytes) -> bytes:
    """Error 199 in the call's cniVersion; a request that could not be read has none."""
    return error_output(CniError(Code.UNEXPECTED, msg), stdin)


def _receive_length(
    connection: socket.socket, field: str, limit: int, deadline: float | None
) -> int:
    size = int.from_bytes(_receive_exactly(connection, LENGTH_BYTES, deadline), "big")
    if size > limit:
        raise ProtocolError(f"the call's {field} of {size} bytes is over the limit of {limit}")
    return size


def _receive_exactly(connection: socket.socket, size: int, deadline: float | None) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = _receive(connection, min(size - len(data), 1 << 16), deadline)
        if not chunk:
            raise ProtocolError("the plugin closed the connection before sending its call")
        data += chunk
    return bytes(data)


def _receive(connection: socket.socket, size: int, deadline: float | None) -> bytes:
    _arm(connection, deadline)
    try:
        return connection.recv(size)
    except TimeoutError as err:
        raise DeadlineExceeded from err


def _arm(connection: socket.socket, deadline: float | None) -> None:
    """Make the next read on connection end by the deadline, if there is one."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded
    connection.settimeout(left)


def _given_up(connection: socket.socket) -> bool:
    """Whether the plugin has hung up (shut its reading end, or closed): it then runs the call
    itself when it finds the request unread, so a request read after that must not run. The
    plugin hangs up before it looks, and this is asked after the whole request was read, so
    the two never both run a call (cni/client.c, the pickup deadline)."""
    poller = select.poll()
    poller.register(connection, 0)  # POLLHUP is always reported
    return any(events & select.POLLHUP for _, events in poller.poll(0))


def _drain(connection: socket.socket, deadline: float) -> None:
    """Read what the plugin still sends, until the deadline: closing on unread data resets
    the connection, which fails the plugin's next read after the answer (the executable
    takes that for the answer's end, other readers may not)."""
    connection.shutdown(socket.SHUT_WR)
    try:
        while _receive(connection, 1 << 16, deadline):
            pass
    except DeadlineExceeded:
        pass
