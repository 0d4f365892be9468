"""Traffic endpoints for tests, run inside namespaces.

serve HOST PORT [tcp|udp|sctp] [LABEL]: answers every TCP or SCTP connection (or UDP datagram) with
"<client address> <LABEL>", the client address as the server saw it (an IPv4 client of a
dual-stack socket without its ::ffff: prefix) and LABEL defaulting to the server's address; a
TCP connection then echoes every line it receives, so a held connection can prove it still
works.
request HOST PORT [tcp|udp|sctp] [SOURCE_PORT]: prints the server's answer.
hold HOST PORT: connects, prints the greeting, then sends each stdin line and prints the echo.
repeat HOST PORT [HOST ...]: connects to each HOST on PORT in turn, reading each greeting,
over and over until stdin has input or closes; then prints as JSON each host's answers
(the greeting's LABEL) and every failure (an error with the step it came at and when, or a
connection closed without a word).
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time

_PROTOCOLS = {"tcp": socket.IPPROTO_TCP, "sctp": socket.IPPROTO_SCTP}


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _client(peer: str) -> str:
    return peer.removeprefix("::ffff:")


def _answer(conn: socket.socket, peer: str, label: str) -> None:
    with conn:
        conn.sendall(f"{_client(peer)} {label or _client(conn.getsockname()[0])}\n".encode())
        while data := conn.recv(2048):
            conn.sendall(data)


def _stream(host: str, proto: str) -> socket.socket:
    """A TCP socket, or a one-to-one SCTP one (which the stream calls treat alike)."""
    return socket.socket(_family(host), socket.SOCK_STREAM, _PROTOCOLS[proto])


def serve(host: str, port: int, proto: str = "tcp", label: str = "") -> None:
    if proto == "udp":
        sock = socket.socket(_family(host), socket.SOCK_DGRAM)
    else:
        sock = _stream(host, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    if proto == "udp":
        print("ready", flush=True)
        while True:
            _, peer = sock.recvfrom(2048)
            sock.sendto(f"{_client(peer[0])} {label or host}\n".encode(), peer)
    sock.listen(64)
    print("ready", flush=True)
    while True:
        conn, peer = sock.accept()
        threading.Thread(target=_answer, args=(conn, peer[0], label), daemon=True).start()


def request(host: str, port: int, proto: str, source_port: int = 0) -> None:
    if proto == "udp":
        sock = socket.socket(_family(host), socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if source_port:
            sock.bind(("::" if ":" in host else "0.0.0.0", source_port))
        sock.settimeout(2)
        sock.sendto(b"hi", (host, port))
        print(sock.recvfrom(2048)[0].decode().strip())
        return
    if proto == "sctp":
        with _stream(host, proto) as conn:
            conn.settimeout(3)
            conn.connect((host, port))
            print(conn.makefile().readline().strip())
        return
    with socket.create_connection((host, port), timeout=3) as conn:
        print(conn.makefile().readline().strip())


def hold(host: str, port: int) -> None:
    with socket.create_connection((host, port), timeout=10) as conn:
        stream = conn.makefile("rw")
        print(stream.readline().strip(), flush=True)
        for line in sys.stdin:
            stream.write(line)
            stream.flush()
            print(stream.readline().strip(), flush=True)


def repeat(hosts: list[str], port: int) -> None:
    answers: dict[str, list[str]] = {}
    failures: list[str] = []
    while not select.select([sys.stdin], [], [], 0)[0]:
        for host in hosts:
            began, stage = time.monotonic(), "connect"
            try:
                with socket.create_connection((host, port), timeout=3) as conn:
                    stage = f"read from source port {conn.getsockname()[1]}"
                    greeting = conn.makefile().readline().split()
            except OSError as err:
                spent = time.monotonic() - began
                failures.append(f"{host}: {err!r} at {stage} after {spent:.2f} s")
                continue
            if greeting:
                answers.setdefault(host, []).append(greeting[1])
            else:
                failures.append(f"{host}: no answer")
    print(json.dumps({"answers": answers, "failures": failures}))


if __name__ == "__main__":
    mode, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "hold":
        hold(host, port)
    elif mode == "repeat":
        repeat([host, *sys.argv[4:]], port)
    elif mode == "serve":
        serve(host, port, *sys.argv[4:6])
    else:
        request(
            host,
            port,
            sys.argv[4] if len(sys.argv) > 4 else "tcp",
            int(sys.argv[5]) if len(sys.argv) > 5 else 0,
        )
