"""The lab's one door between the host and the lab's network, run as one process.

The apiserver listens on host loopback; nodes and pods live in namespaces with no route to it.
- Into the lab: a relay listening inside the control-plane host's namespace on the address and
  port the apiserver advertises (so the `kubernetes` Service's endpoint) to the apiserver.
- Out of the apiserver: an HTTP CONNECT proxy on a unix socket, named by the apiserver's
  EgressSelectorConfiguration for the `cluster` egress, which dials kubelets (logs, exec,
  port-forward), pods and services (the apiserver's proxy) from inside a node's namespace:
  only nodes have routes to the pods' addresses, as on kind, where the control plane is a node.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import threading
from pathlib import Path

from deploy.lab.relay import NetnsForward, pump, socket_in

MAX_REQUEST = 8192


def _read_request(client: socket.socket) -> bytes:
    """The CONNECT request's head (up to the blank line)."""
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = client.recv(1024)
        if not chunk or len(head) > MAX_REQUEST:
            raise ConnectionError("no complete CONNECT request")
        head += chunk
    return head


def _target(head: bytes) -> tuple[str, int]:
    """host and port of `CONNECT host:port HTTP/1.1` (an IPv6 host in brackets)."""
    method, target, _ = head.split(b"\r\n", 1)[0].decode("ascii").split(" ", 2)
    if method != "CONNECT":
        raise ValueError(f"not a CONNECT request: {method}")
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


class ConnectProxy:
    """HTTP CONNECT on a unix socket, dialing from inside network namespace NETNS."""

    def __init__(self, path: Path, netns: str) -> None:
        self.netns = netns
        path.unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(64)
        threading.Thread(target=self._accept, name="egress", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        with client:
            try:
                host, port = _target(_read_request(client))
                family = socket.AF_INET6 if ":" in host else socket.AF_INET
                upstream = socket_in(self.netns, lambda: socket.socket(family))
            except (OSError, ValueError, ConnectionError) as err:
                with contextlib.suppress(OSError):
                    client.sendall(f"HTTP/1.1 400 Bad Request\r\n\r\n{err}".encode())
                return
            with upstream:
                try:
                    upstream.settimeout(10)
                    upstream.connect((host, port))
                    upstream.settimeout(None)
                except OSError as err:
                    with contextlib.suppress(OSError):
                        client.sendall(f"HTTP/1.1 502 Bad Gateway\r\n\r\n{err}".encode())
                    return
                client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
                back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
                back.start()
                pump(client, upstream)
                back.join()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--netns", required=True, help="the control-plane host's namespace")
    parser.add_argument("--address", required=True, help="the address the apiserver advertises")
    parser.add_argument("--apiserver-port", type=int, required=True)
    parser.add_argument("--egress-socket", type=Path, required=True)
    parser.add_argument("--egress-netns", required=True, help="a node's namespace")
    options = parser.parse_args()
    done = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    port = options.apiserver_port
    relay = NetnsForward(options.netns, port, listen_port=port, address=options.address)
    egress = ConnectProxy(options.egress_socket, options.egress_netns)
    done.wait()
    egress.stop()
    relay.stop()


if __name__ == "__main__":
    main()
