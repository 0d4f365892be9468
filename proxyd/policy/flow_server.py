"""The daemon's flow records, served on a unix socket beside the CNI socket (`flows.sock` in
its folder): 0600 in a 0700 folder, and a peer whose uid is not 0 is refused, as the CNI
socket does (cni/server.py), so that no pod reads the node's connections (the check comes
after the request line, so another user can hold one of the READERS slots for
REQUEST_TIMEOUT at most). A socket rather than
a path on the metrics or health server: those listen on TCP, which a host-network pod reaches.

The wire: the client sends one JSON line, `{"follow": BOOL}`; the server answers with the
records the ring holds, one JSON object a line, oldest first, then, when following, each new
one as it comes, until the client hangs up.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

from cni.server import listen_private, peer
from proxyd.policy.flows import Ring

log = logging.getLogger(__name__)

SOCKET_NAME = "flows.sock"
DEFAULT_FOLDER = "/run/knit"
"""The folder when the daemon has no CNI socket."""
READERS = 8
"""Readers served at once: each holds a thread while it follows."""
REQUEST_TIMEOUT = 2.0
FOLLOW_WAIT = 1.0
"""How long a follower's thread waits for a record before it looks whether to stop."""


def socket_path(cni_socket: str) -> str:
    folder = str(Path(cni_socket).parent) if cni_socket else DEFAULT_FOLDER
    return os.path.join(folder, SOCKET_NAME)


class FlowServer:
    def __init__(self, path: str, ring: Ring) -> None:
        self.ring = ring
        self._listener, self.path = listen_private(path)
        self._slots = threading.BoundedSemaphore(READERS)
        self._closing = threading.Event()
        threading.Thread(target=self._accept, name="flow-server", daemon=True).start()

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                connection, _ = self._listener.accept()
            except OSError:
                continue
            if not self._slots.acquire(blocking=False):
                connection.close()
                continue
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            with connection, connection.makefile("rb") as requests:
                connection.settimeout(REQUEST_TIMEOUT)
                # read before any answer: closing a unix socket with unread data resets it
                follow = bool(json.loads(requests.readline() or b"{}").get("follow"))
                pid, uid = peer(connection)
                if uid != 0:
                    log.warning("flow records: refused uid %d (pid %d): not root", uid, pid)
                    self._send(connection, [{"error": f"only root reads flows, not uid {uid}"}])
                    return
                connection.settimeout(None)
                items, last = self.ring.after(-1)
                self._send(connection, items)
                while follow and not self._closing.is_set() and not _hung_up(connection):
                    items, last = self.ring.after(last, FOLLOW_WAIT)
                    self._send(connection, items)
        except (OSError, ValueError, AttributeError):
            pass  # a reader gone, or one that does not speak this protocol
        finally:
            self._slots.release()

    def _send(self, connection: socket.socket, items: list[dict[str, Any]]) -> None:
        if items:
            connection.sendall(b"".join(json.dumps(item).encode() + b"\n" for item in items))


def _hung_up(connection: socket.socket) -> bool:
    """Whether the reader closed its end (it sends nothing after its request)."""
    try:
        return connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False


def read(path: str, follow: bool) -> Generator[dict[str, Any], None, None]:
    """The records a daemon serves at `path` (as root), and new ones when following."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.connect(path)
        connection.sendall(json.dumps({"follow": follow}).encode() + b"\n")
        with connection.makefile("rb") as lines:
            for line in lines:
                item = json.loads(line)
                if "error" in item:
                    raise PermissionError(item["error"])
                yield item
