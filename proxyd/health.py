"""HTTP endpoints: /healthz and /livez (kube-proxy's semantics), /metrics and /proxyMode, and
one health-check server per healthCheckNodePort of externalTrafficPolicy Local services."""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], routes: dict[str, Callable[[], Response]]) -> None:
        self.routes = routes
        if family_of(address[0]) == 6:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        if self.address_family == socket.AF_INET6:
            # `::` takes IPv4 too, whatever net.ipv6.bindv6only says.
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        routes = self.server.routes
        route = routes.get(self.path.split("?", 1)[0]) or routes.get("*")
        answer = route() if route else Response(404, "text/plain", b"not found\n")
        self.send_response(answer.status)
        self.send_header("Content-Type", answer.content_type)
        self.send_header("X-Content-Type-Options", "nosniff")
        for name, value in answer.headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(answer.body)))
        self.end_headers()
        self.wfile.write(answer.body)

    def log_message(self, format: str, *args: object) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def _start(server: _Server, name: str) -> _Server:
    threading.Thread(target=server.serve_forever, name=name, daemon=True).start()
    return server


def split_address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]") or "0.0.0.0", int(port)


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


def serve_health(address: str, health: ProxyHealth, metrics: Metrics) -> _Server:
    def answer(check_node: bool, counter: object) -> Response:
        status = health.status()
        eligible = not health.node_deleting if check_node else None
        ok = status.healthy and eligible is not False
        code = 200 if ok else 503
        counter.labels(code=str(code)).inc()  # type: ignore[attr-defined]
        body = json.dumps(health_body(status, eligible, ok)).encode()
        return Response(code, "application/json", body, (("X-Content-Type-Options", "nosniff"),))

    routes = {
        "/healthz": lambda: answer(True, metrics.healthz),
        "/livez": lambda: answer(False, metrics.livez),
    }
    return _start(_Server(split_address(address), routes), "healthz")


def serve_metrics(address: str, metrics: Metrics, mode: str) -> _Server:
    routes: dict[str, Callable[[], Response]] = {
        "/metrics": lambda: Response(200, "text/plain; version=0.0.4", metrics.exposition()),
        "/proxyMode": lambda: Response(200, "text/plain", mode.encode()),
        "/healthz": lambda: Response(200, "text/plain", b"ok"),
    }
    return _start(_Server(split_address(address), routes), "metrics")


class ServiceHealthServers:
    """One HTTP server per healthCheckNodePort, answering with the local endpoint count (also
    in kube-proxy's X-Load-Balancing-Endpoint-Weight header), on every address of both
    families, or of IPv4 alone when the node has no IPv6."""

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
            server = self._servers.pop(port)
            server.shutdown()
            server.server_close()
        for port in wanted.keys() - self._servers.keys():
            try:
                server = self._bind(port)
            except OSError as err:
                log.error("cannot serve health check node port %d: %s", port, err)
                continue
            self._servers[port] = _start(server, f"health-{port}")

    def _bind(self, port: int) -> _Server:
        routes = {"*": lambda: self._answer(port)}
        try:
            return _Server((self._bind_host, port), routes)
        except OSError as err:
            if err.errno != errno.EAFNOSUPPORT or self._bind_host != "::":
                raise
            return _Server(("0.0.0.0", port), routes)

    def close(self) -> None:
        self.update({})
