"""Steady clients for the chaos run (deploy/lab/chaos.py), started inside a node's network
namespace. Each writes one line per attempt, `TIME OUTCOME` (TIME in wall-clock seconds), so
its failures can be placed beside faults injected at known times:

- `http URL`: a new connection per request, 2 s to answer; `ok` or `failed ERROR`;
- `udp HOST PORT`: a datagram to agnhost netexec's UDP server from one source port held for the
  whole run, 1 s to answer; `ok` or `failed ERROR`. One source port keeps one conntrack entry,
  so an entry left pointing at a deleted endpoint shows as failures that never end;
- `hold HOST PORT`: one HTTP/1.1 connection kept open, a request on it every half second; `ok`,
  or `broken` when it stops answering, after which a new connection is opened.

ERROR names how an attempt failed (TimeoutError: no answer, ConnectionRefusedError: a reject
or a reset at once, ...), which tells a rule that drops from one that rejects.
"""

from __future__ import annotations

import argparse
import http.client
import socket
import sys
import time
import urllib.error
import urllib.request

INTERVAL = 0.1
HOLD_INTERVAL = 0.5


def _say(outcome: str) -> None:
    sys.stdout.write(f"{time.time():.3f} {outcome}\n")
    sys.stdout.flush()


def _failed(err: OSError) -> None:
    # urllib wraps a connection's error in a URLError, whose reason is the error itself
    cause = err.reason if isinstance(err, urllib.error.URLError) else err
    _say(f"failed {type(cause).__name__}")


def http_loop(url: str) -> None:
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                answer.read()
            _say("ok")
        except OSError as err:
            _failed(err)
        time.sleep(INTERVAL)


def udp_loop(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.settimeout(1.0)
        sock.connect((host, port))
        while True:
            try:
                sock.send(b"hostname")
                sock.recv(512)
                _say("ok")
            except OSError as err:
                _failed(err)
            time.sleep(INTERVAL)


def hold(host: str, port: int) -> None:
    while True:
        connection = http.client.HTTPConnection(host, port, timeout=2)
        try:
            while True:
                connection.request("GET", "/hostname")
                connection.getresponse().read()
                _say("ok")
                time.sleep(HOLD_INTERVAL)
        except (OSError, http.client.HTTPException):
            _say("broken")
        finally:
            connection.close()
        time.sleep(HOLD_INTERVAL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("kind", choices=["http", "udp", "hold"])
    parser.add_argument("target", nargs="+", help="URL (http) or HOST PORT (udp, hold)")
    options = parser.parse_args()
    try:
        if options.kind == "http":
            http_loop(options.target[0])
        host, port = options.target
        (udp_loop if options.kind == "udp" else hold)(host, int(port))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
