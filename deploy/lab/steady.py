"""Steady clients for the chaos run (deploy/lab/chaos.py), started inside a node's network
namespace. Each writes one line per attempt, `TIME OUTCOME` (TIME in wall-clock seconds), so
its failures can be placed beside faults injected at known times:

- `http HOST PORT`: a new connection per request (HTTP/1.0 GET /hostname), 2 s for each step;
  `ok` or `failed ERROR/STEP from port N`, STEP being `connect` (no SYN-ACK: the SYN or its
  answer was lost) or `answer` (connected, then no whole answer in time), N the source port,
  to find the attempt in a capture or a conntrack listing;
- `udp HOST PORT`: a numbered datagram (`echo N`) to agnhost netexec's UDP server from one
  source port held for the whole run, 1 s to answer; `ok` or `failed ERROR/answer of attempt
  N`, and `late N by S s` when attempt N's answer came after all (it was slow, not lost). One
  source port keeps one conntrack entry, so an entry left pointing at a deleted endpoint shows
  as failures that never end;
- `hold HOST PORT`: one HTTP/1.1 connection kept open, a request on it every half second; `ok`,
  or `broken` when it stops answering, after which a new connection is opened.

ERROR names how an attempt failed (TimeoutError: no answer, ConnectionRefusedError: a reject
or a reset at once, ...), which tells a rule that drops from one that rejects; the report
counts failures by it (what follows it is detail).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import socket
import sys
import time

INTERVAL = 0.1
UDP_TIMEOUT = 1.0
UDP_LATE = 30.0
"""Seconds a UDP attempt's answer is still logged as late, after its timeout."""
HOLD_INTERVAL = 0.5


def _say(outcome: str) -> None:
    sys.stdout.write(f"{time.time():.3f} {outcome}\n")
    sys.stdout.flush()


def http_loop(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    request = f"GET /hostname HTTP/1.0\r\nHost: {host}\r\n\r\n".encode()
    while True:
        step = "connect"
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(2.0)
            try:
                sock.connect((host, port))
                step = "answer"
                sock.sendall(request)
                answer = b"".join(iter(lambda: sock.recv(4096), b""))
                status = answer.split(maxsplit=2)[1:2]
                if not status:  # closed without a status line
                    _say(f"failed NoAnswer/{step}")
                else:
                    _say("ok" if status[0].startswith(b"2") else f"failed HTTPError/{step}")
            except OSError as err:
                _say(f"failed {type(err).__name__}/{step} from port {sock.getsockname()[1]}")
        time.sleep(INTERVAL)


def udp_loop(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sent: dict[int, float] = {}
    """When each attempt still unanswered was sent (monotonic), by its number."""
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect((host, port))
        for attempt in itertools.count():
            sent[attempt] = time.monotonic()
            deadline = sent[attempt] + UDP_TIMEOUT
            try:
                sock.send(f"echo {attempt}".encode())
                while True:
                    sock.settimeout(max(deadline - time.monotonic(), 0.001))
                    answered = int(sock.recv(512) or -1)
                    if (began := sent.pop(answered, None)) is None:
                        continue
                    if answered == attempt:
                        _say("ok")
                        break
                    # an earlier attempt's answer, after its own timeout
                    _say(f"late {answered} by {time.monotonic() - began:.3f} s")
            except (OSError, ValueError) as err:
                _say(f"failed {type(err).__name__}/answer of attempt {attempt}")
            for stale in [n for n, at in sent.items() if at < time.monotonic() - UDP_LATE]:
                del sent[stale]
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
    parser.add_argument("host")
    parser.add_argument("port", type=int)
    options = parser.parse_args()
    loops = {"http": http_loop, "udp": udp_loop, "hold": hold}
    with contextlib.suppress(KeyboardInterrupt):
        loops[options.kind](options.host, options.port)


if __name__ == "__main__":
    main()
