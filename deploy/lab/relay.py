"""A TCP relay into a network namespace: `NetnsForward` listens inside one and relays each
connection to a port of this process's own namespace, so that a daemon in a node namespace
reaches the control plane on host loopback without any change to the host namespace's
network.

CLI: `--netns NETNS --target-port PORT` relays 127.0.0.1:6443 in NETNS to 127.0.0.1:PORT here
until SIGTERM or SIGINT (the lab's per-node API access).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from cni.kernel.netns import entered, open_netns

NETNS_PORT = 6443


class RelayError(RuntimeError):
    """The relay cannot listen where it was asked to."""


def socket_in(netns: str, make: Callable[[], socket.socket]) -> socket.socket:
    """The socket make() returns, made inside /run/netns/NETNS by a thread of its own that
    entered the namespace: the socket stays there, the caller's thread never changes it."""

    def made_inside() -> socket.socket:
        fd = open_netns(f"/run/netns/{netns}")
        try:
            with entered(fd):
                return make()
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max_workers=1) as one:
        return one.submit(made_inside).result()


def _listen_in(netns: str, address: str, port: int) -> socket.socket:
    """A socket listening on address:port inside /run/netns/NETNS."""
    try:
        return socket_in(netns, lambda: socket.create_server((address, port)))
    except OSError as err:
        raise RelayError(
            f"cannot listen on {address}:{port} in netns {netns} (is lo up there?): {err}"
        ) from err


def pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


class NetnsForward:
    """Listen on address:listen_port inside network namespace NETNS (/run/netns/NETNS) and
    relay every connection to target_host:target_port in this process's own namespace."""

    def __init__(
        self,
        netns: str,
        target_port: int,
        listen_port: int = NETNS_PORT,
        address: str = "127.0.0.1",
        target_host: str = "127.0.0.1",
    ) -> None:
        self.netns = netns
        self.target_host = target_host
        self.target_port = target_port
        self.listen_port = listen_port
        self._listener = _listen_in(netns, address, listen_port)
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._acceptor = threading.Thread(target=self._accept, name=f"forward-{netns}", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stop() shut the listener down
            try:
                upstream = socket.create_connection((self.target_host, self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            relay = threading.Thread(target=self._relay, args=(client, upstream), daemon=True)
            with self._lock:
                self._sockets.update((client, upstream))
                self._threads.add(relay)
            relay.start()

    def _relay(self, client: socket.socket, upstream: socket.socket) -> None:
        back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        back.start()
        pump(client, upstream)
        back.join()
        with self._lock:
            self._sockets -= {client, upstream}
            self._threads.discard(threading.current_thread())
        client.close()
        upstream.close()

    def stop(self) -> None:
        """Close the listener and every relayed connection; calling it again does nothing."""
        with contextlib.suppress(OSError):  # already closed by an earlier stop()
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._acceptor.join()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            relays = list(self._threads)
        for relay in relays:
            relay.join()


def forward_until_signalled(netns: str, target_port: int, target_host: str) -> None:
    """Run a NetnsForward until SIGTERM or SIGINT (the lab's per-node API access)."""
    done = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    forward = NetnsForward(netns, target_port, target_host=target_host)
    done.wait()
    forward.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--netns", required=True)
    parser.add_argument("--target-port", type=int, required=True)
    parser.add_argument("--target-host", default="127.0.0.1")
    options = parser.parse_args()
    forward_until_signalled(options.netns, options.target_port, options.target_host)


if __name__ == "__main__":
    main()
