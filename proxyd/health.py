"""HTTP endpoints: /healthz and /livez (kube-proxy's semantics), /metrics and /proxyMode, and
one health-check server per healthCheckNodePort of externalTrafficPolicy Local services."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from email.utils import formatdate
from http import HTTPStatus
from typing import NamedTuple

from proxyd.metrics import Metrics, family_label
from proxyd.model import family_of

log = logging.getLogger(__name__)


def _stamp(seconds: float | None) -> str:
    """RFC 3339 in UTC; Go's zero time (what kube-proxy shows) for never."""
    if seconds is None:
        return "0001-01-01T00:00:00Z"
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


class HealthStatus(NamedTuple):
    healthy: bool
    last_updated: float | None
    """The latest successful sync of any family."""
    now: float
    families: dict[int, tuple[bool, float]]
    """Per family synced at least once: (healthy, its last successful sync)."""


class ProxyHealth:
    """Per IP family, healthy unless a queued change has waited longer than `timeout` for that
    family's successful sync (kube-proxy's rule, one proxier per family); a failed sync of the
    family counts as such a change. A family never synced yet is reported healthy."""

    def __init__(
        self, families: tuple[int, ...], timeout: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.families = families
        self.timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._last_updated: dict[int, float] = {}
        self._oldest_queued: dict[int, float] = {}
        self.node_deleting = False

    def queued(self, families: frozenset[int]) -> None:
        """A change to these families waits for a sync."""
        with self._lock:
            now = self._clock()
            for family in families & set(self.families):
                self._oldest_queued.setdefault(family, now)

    def synced(self, failed: frozenset[int] = frozenset()) -> None:
        """A sync ended: the families not in `failed` are up to date; a failed family waits for
        the next sync as a queued change to it does."""
        with self._lock:
            now = self._clock()
            for family in self.families:
                if family in failed:
                    self._oldest_queued.setdefault(family, now)
                else:
                    self._last_updated[family] = now
                    self._oldest_queued.pop(family, None)

    def status(self) -> HealthStatus:
        with self._lock:
            now = self._clock()
            families = {
                family: (
                    now - self._oldest_queued.get(family, now) < self.timeout,
                    updated,
                )
                for family, updated in sorted(self._last_updated.items())
            }
            last = max(self._last_updated.values(), default=None)
            healthy = all(ok for ok, _ in families.values())
            return HealthStatus(healthy, last, now, families)


class Response(NamedTuple):
    status: int
    content_type: str
    body: bytes
    headers: tuple[tuple[str, str], ...] = ()


Route = Callable[[], Response]

REQUEST_SECONDS = 5.0
"""How long a connection has, from its accept, to send its request and read the answer."""
MAX_CONNECTIONS = 512
"""Connections open at once over every server of a loop; past it, a new one closes the oldest
of the source holding most."""
MAX_PER_SOURCE = 64
"""Connections open at once from one address; past it, a new one closes that address's
oldest."""
MAX_REQUEST_HEAD = 8192
"""Bytes of request line and headers; past them, the answer is 431."""
ACCEPTS_PER_WAKE = 64
"""Accepts in a row on one listener before the loop serves the rest again."""


class _Server:
    """A listening socket and its routes (path, or "*" for any), served by the shared loop."""

    def __init__(self, address: tuple[str, int], routes: dict[str, Route], name: str) -> None:
        family = socket.AF_INET6 if family_of(address[0]) == 6 else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                # `::` takes IPv4 too, whatever net.ipv6.bindv6only says.
                self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            self.socket.bind(address)
            self.socket.listen(socket.SOMAXCONN)
            self.socket.setblocking(False)
        except BaseException:
            self.socket.close()
            raise
        self.routes = routes
        self.name = name
        self.server_address: tuple[str, int] = self.socket.getsockname()[:2]

    loop: _Loop

    def close(self) -> None:
        """Stop listening, and close the connections this server accepted."""
        self.loop.stop(self)


class _Connection:
    __slots__ = ("deadline", "received", "server", "sock", "source", "unsent")

    def __init__(self, sock: socket.socket, server: _Server, source: str, deadline: float) -> None:
        self.sock = sock
        self.server = server
        self.source = source
        self.deadline = deadline
        self.received = b""
        self.unsent = b""


def _answer_bytes(server: _Server, head: bytes) -> bytes:
    """The whole HTTP/1.1 answer to a request head; one answer per connection."""
    request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(request_line) != 3 or not request_line[2].startswith("HTTP/"):
        answer = Response(400, "text/plain", b"bad request\n")
    elif request_line[0] != "GET":
        answer = Response(501, "text/plain", b"only GET\n")
    else:
        route = server.routes.get(request_line[1].split("?", 1)[0]) or server.routes.get("*")
        answer = Response(404, "text/plain", b"not found\n")
        if route is not None:
            try:
                answer = route()
            except Exception:
                log.exception("%s: answering %s failed", server.name, request_line[1])
                answer = Response(500, "text/plain", b"internal error\n")
    return _encode(answer)


def _encode(answer: Response) -> bytes:
    lines = [
        f"HTTP/1.1 {answer.status} {HTTPStatus(answer.status).phrase}",
        f"Date: {formatdate(usegmt=True)}",
        f"Content-Type: {answer.content_type}",
        "X-Content-Type-Options: nosniff",
        *(f"{name}: {value}" for name, value in answer.headers),
        f"Content-Length: {len(answer.body)}",
        "Connection: close",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + answer.body


class _Loop:
    """One thread serving its _Servers with a selector: a connection costs a descriptor and a
    few hundred bytes, never a thread. Each gets REQUEST_SECONDS for its whole exchange, at
    most MAX_PER_SOURCE are open from one address and MAX_CONNECTIONS in all, so connections
    left idle (from any pod: healthz and health-check node ports listen on every address)
    cannot hold back a real client or the daemon's descriptors: a flood closes its own
    connections first, not a load balancer's probe. The answers are small and computed at
    once, so the loop answers in its own thread; /metrics, whose answer reads the kernel's
    counters, has a loop of its own."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._selector = selectors.DefaultSelector()
        self._connections: dict[int, _Connection] = {}
        """By descriptor, oldest first: with one timeout for all, also by deadline."""
        self._by_source: Counter[str] = Counter()
        self._wake, self._waker = socket.socketpair()
        self._wake.setblocking(False)
        self._selector.register(self._wake, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._changes: list[tuple[Callable[[], object], threading.Event]] = []
        self._thread: threading.Thread | None = None

    def serve(self, server: _Server) -> None:
        self._in_loop(lambda: self._selector.register(server.socket, selectors.EVENT_READ, server))

    def stop(self, server: _Server) -> None:
        self._in_loop(lambda: self._drop(server))

    def _in_loop(self, change: Callable[[], object]) -> None:
        """Run change in the loop's thread and wait for it: only that thread touches the
        selector and the connections."""
        done = threading.Event()
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._changes.append((change, done))
        self._waker.send(b"\0")
        done.wait()

    def _drop(self, server: _Server) -> None:
        self._selector.unregister(server.socket)
        server.socket.close()
        for conn in [c for c in self._connections.values() if c.server is server]:
            self._close(conn)

    def _run(self) -> None:
        while True:
            oldest = next(iter(self._connections.values()), None)
            timeout = None if oldest is None else max(0.0, oldest.deadline - time.monotonic())
            for key, events in self._selector.select(timeout):
                try:
                    self._ready(key.data, events)
                except Exception:
                    log.exception("serving %r failed", key.data)
                    if isinstance(key.data, _Connection):
                        self._close(key.data)
            now = time.monotonic()
            while self._connections:
                oldest = next(iter(self._connections.values()))
                if oldest.deadline > now:
                    break
                self._close(oldest)

    def _ready(self, owner: _Server | _Connection | None, events: int) -> None:
        if owner is None:
            self._apply_changes()
        elif isinstance(owner, _Server):
            if owner.socket.fileno() != -1:  # not dropped earlier in this round
                self._accept(owner)
        elif owner.sock.fileno() in self._connections:  # not closed earlier in this round
            if events & selectors.EVENT_WRITE:
                self._send(owner)
            else:
                self._receive(owner)

    def _apply_changes(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake.recv(4096):
                pass
        with self._lock:
            changes, self._changes = self._changes, []
        for change, done in changes:
            try:
                change()
            except Exception:
                log.exception("changing the served addresses failed")
            finally:
                done.set()

    def _accept(self, server: _Server) -> None:
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, peer = server.socket.accept()
            except BlockingIOError:
                return
            except OSError as err:
                if err.errno not in (errno.EMFILE, errno.ENFILE):
                    continue  # the peer gave up (ECONNABORTED) before the accept
                if not self._connections:
                    # Nothing of ours to close, and the listener stays readable: do not spin.
                    log.warning("%s: out of descriptors, not accepting for 1s", server.name)
                    time.sleep(1)
                    return
                self._close(next(iter(self._connections.values())))
                continue
            source = str(peer[0])
            if self._by_source[source] >= MAX_PER_SOURCE:
                self._close(self._oldest_from(source))
            elif len(self._connections) >= MAX_CONNECTIONS:
                self._close(self._oldest_from(self._by_source.most_common(1)[0][0]))
            sock.setblocking(False)
            conn = _Connection(sock, server, source, time.monotonic() + REQUEST_SECONDS)
            self._connections[sock.fileno()] = conn
            self._by_source[source] += 1
            self._selector.register(sock, selectors.EVENT_READ, conn)
            # A real client's request is usually there by the accept: answered now, it is
            # not evicted by the connections accepted after it.
            self._receive(conn)

    def _oldest_from(self, source: str) -> _Connection:
        return next(c for c in self._connections.values() if c.source == source)

    def _receive(self, conn: _Connection) -> None:
        try:
            chunk = conn.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn)
            return
        conn.received += chunk
        head_end = conn.received.find(b"\r\n\r\n")
        if head_end >= 0:
            conn.unsent = _answer_bytes(conn.server, conn.received[:head_end])
        elif len(conn.received) > MAX_REQUEST_HEAD:
            conn.unsent = _encode(Response(431, "text/plain", b"request head too large\n"))
        else:
            return
        self._send(conn)

    def _send(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.unsent)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(conn)
            return
        conn.unsent = conn.unsent[sent:]
        if conn.unsent:
            self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        else:
            self._close(conn)

    def _close(self, conn: _Connection) -> None:
        if self._connections.pop(conn.sock.fileno(), None) is None:
            return  # closed already (a closed socket's descriptor reads -1)
        self._by_source[conn.source] -= 1
        if not self._by_source[conn.source]:
            del self._by_source[conn.source]
        self._selector.unregister(conn.sock)
        conn.sock.close()


_HEALTH_LOOP = _Loop("http-health")
_METRICS_LOOP = _Loop("http-metrics")


def _start(server: _Server, loop: _Loop = _HEALTH_LOOP) -> _Server:
    server.loop = loop
    loop.serve(server)
    return server


def split_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


class PolicyHealth(NamedTuple):
    """One family's NetworkPolicy enforcement, for /healthz."""

    healthy: bool
    """Not failing, or failing for less than the health timeout."""
    last_updated: float | None
    """The family's last successful policy sync (wall clock), if any."""
    quarantined: int
    """Pods whose rules nft refused, dropping everything (contained: still healthy)."""


def policy_body(policy: Mapping[int, PolicyHealth]) -> dict[str, object]:
    """knit's own part of /healthz: each family's policy enforcement."""
    return {
        family_label(family): {
            "healthy": health.healthy,
            "lastUpdated": _stamp(health.last_updated),
            "quarantinedPods": health.quarantined,
        }
        for family, health in sorted(policy.items())
    }


def health_body(status: HealthStatus, node_eligible: bool | None, ok: bool) -> dict[str, object]:
    """kube-proxy's /healthz and /livez JSON: lastUpdated reads `now` when answering ok (its
    compatibility rule), nodeEligible only on /healthz, and the state of each family."""
    body: dict[str, object] = {
        "lastUpdated": _stamp(status.now if ok else status.last_updated),
        "currentTime": _stamp(status.now),
    }
    if node_eligible is not None:
        body["nodeEligible"] = node_eligible
    body["healthy"] = status.healthy
    if status.families:
        body["status"] = {
            family_label(family): {"lastUpdated": _stamp(updated), "healthy": ok}
            for family, (ok, updated) in status.families.items()
        }
    return body


def serve_health(
    address: str,
    health: ProxyHealth,
    metrics: Metrics,
    policy: Callable[[], Mapping[int, PolicyHealth]] | None = None,
) -> _Server:
    """`policy`: NetworkPolicy enforcement's health, which /healthz reports and answers 503 for
    when it fails, and /livez leaves out: a restart cannot mend a table nft refuses."""

    def answer(check_node: bool, counter: object) -> Response:
        status = health.status()
        eligible = not health.node_deleting if check_node else None
        enforced = policy() if policy is not None and check_node else {}
        ok = status.healthy and eligible is not False
        body = health_body(status, eligible, ok)
        if enforced:
            ok = ok and all(family.healthy for family in enforced.values())
            body["policy"] = policy_body(enforced)
        code = 200 if ok else 503
        counter.labels(code=str(code)).inc()  # type: ignore[attr-defined]
        return Response(code, "application/json", json.dumps(body).encode())

    routes = {
        "/healthz": lambda: answer(True, metrics.healthz),
        "/livez": lambda: answer(False, metrics.livez),
    }
    return _start(_Server(split_address(address), routes, "healthz"))


def serve_metrics(address: str, metrics: Metrics, mode: str) -> _Server:
    routes: dict[str, Route] = {
        "/metrics": lambda: Response(200, "text/plain; version=0.0.4", metrics.exposition()),
        "/proxyMode": lambda: Response(200, "text/plain", mode.encode()),
        "/healthz": lambda: Response(200, "text/plain", b"ok"),
    }
    return _start(_Server(split_address(address), routes, "metrics"), _METRICS_LOOP)


class ServiceHealthServers:
    """One HTTP server per healthCheckNodePort (all served by the one loop), answering with
    the local endpoint count (also in kube-proxy's X-Load-Balancing-Endpoint-Weight header),
    on every address of both families, or of IPv4 alone when the node has no IPv6."""

    def __init__(self, health: ProxyHealth, bind_host: str = "::") -> None:
        self._health = health
        self._bind_host = bind_host
        self._servers: dict[int, _Server] = {}
        self._state: dict[int, tuple[str, str, int]] = {}
        self._lock = threading.Lock()

    def _answer(self, port: int) -> Response:
        with self._lock:
            namespace, name, local = self._state[port]
        healthy = self._health.status().healthy
        body = {
            "service": {"namespace": namespace, "name": name},
            "localEndpoints": local,
            "serviceProxyHealthy": healthy,
        }
        code = 200 if local > 0 and healthy else 503
        weight = (("X-Load-Balancing-Endpoint-Weight", str(local)),)
        return Response(code, "application/json", json.dumps(body).encode(), weight)

    def update(self, wanted: dict[int, tuple[str, str, int]]) -> None:
        """wanted: health-check node port -> (namespace, name, local endpoints)."""
        with self._lock:
            self._state = dict(wanted)
        for port in list(self._servers.keys() - wanted.keys()):
            self._servers.pop(port).close()
        for port in wanted.keys() - self._servers.keys():
            try:
                server = self._bind(port)
            except OSError as err:
                log.error("cannot serve health check node port %d: %s", port, err)
                continue
            self._servers[port] = _start(server)

    def _bind(self, port: int) -> _Server:
        routes = {"*": lambda: self._answer(port)}
        name = f"health check node port {port}"
        try:
            return _Server((self._bind_host, port), routes, name)
        except OSError as err:
            if err.errno != errno.EAFNOSUPPORT or self._bind_host != "::":
                raise
            return _Server(("0.0.0.0", port), routes, name)

    def close(self) -> None:
        self.update({})
