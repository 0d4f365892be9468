"""Traffic endpoints for tests, run inside namespaces: a server that answers with the
client's address as it saw it, and a client that prints the answer."""

from __future__ import annotations

import socket
import sys


def serve(host: str, port: int, proto: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    kind = socket.SOCK_DGRAM if proto == "udp" else socket.SOCK_STREAM
    sock = socket.socket(family, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    if proto == "udp":
        print("ready", flush=True)
        while True:
            _, peer = sock.recvfrom(2048)
            sock.sendto(peer[0].encode(), peer)
    sock.listen(64)
    print("ready", flush=True)
    while True:
        conn, peer = sock.accept()
        with conn:
            conn.sendall(peer[0].encode())


def request(host: str, port: int, proto: str) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if proto == "udp":
        sock = socket.socket(family, socket.SOCK_DGRAM)
        sock.settimeout(2)
        sock.sendto(b"hi", (host, port))
        print(sock.recvfrom(2048)[0].decode())
        return
    with socket.create_connection((host, port), timeout=3) as conn:
        print(conn.recv(2048).decode())


if __name__ == "__main__":
    mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    proto = sys.argv[4] if len(sys.argv) > 4 else "tcp"
    (serve if mode == "serve" else request)(host, port, proto)
