"""The lab's gateway: an HTTP CONNECT proxy on a unix socket that dials from inside a network
namespace (the apiserver's way to kubelets), by real connections."""

from __future__ import annotations

import socket
from pathlib import Path

from deploy.lab.gateway import ConnectProxy


def _connect(proxy: Path, target: str) -> tuple[bytes, socket.socket]:
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.settimeout(10)
    client.connect(str(proxy))
    client.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head and (chunk := client.recv(1)):
        head += chunk
    return head.split(b"\r\n", 1)[0], client


def test_connect_proxy_dials_from_inside_the_namespace(make_netns, tmp_path) -> None:
    lab = make_netns("gw")
    lab.ip("addr", "add", "10.99.0.1/24", "dev", "lo")
    lab.ip("-6", "addr", "add", "fd99::1/64", "dev", "lo")
    lab.serve("::", 8080, label="inside")
    proxy = ConnectProxy(tmp_path / "egress.sock", lab.name)
    try:
        for target, seen in (("10.99.0.1:8080", "10.99.0.1"), ("[fd99::1]:8080", "fd99::1")):
            status, tunnel = _connect(tmp_path / "egress.sock", target)
            with tunnel:
                assert status == b"HTTP/1.1 200 Connection established"
                # the server inside saw a client of its own namespace: the dial was made there
                assert tunnel.recv(100).decode().split() == [seen, "inside"]
                tunnel.sendall(b"ping\n")
                assert tunnel.recv(100) == b"ping\n"
        # nothing listens on that port inside; the host's own 127.0.0.1 is never dialed
        status, refused = _connect(tmp_path / "egress.sock", "10.99.0.1:8081")
        refused.close()
        assert status == b"HTTP/1.1 502 Bad Gateway"
        status, bad = _connect(tmp_path / "egress.sock", "no-port")
        bad.close()
        assert status == b"HTTP/1.1 400 Bad Request"
    finally:
        proxy.stop()
