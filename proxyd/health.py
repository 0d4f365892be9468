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

from proxyd.metrics import Metrics

log = logging.getLogger(__name__)


def _stamp(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")


class ProxyHealth:
    """Healthy unless a queued change has waited longer than `timeout` for a successful sync."""

    def __init__(self, timeout: float, clock: Callable[[], float] = time.time) -> None:
        self.timeout = timeout
        self._clock = clock
        self._lock = threading.Lock()
        self._last_updated = 0.0
        self._oldest_queued: float | None = None
        self.node_deleting = False

    def queued(self) -> None:
        with self._lock:
            if self._oldest_queued is None:
                self._oldest_queued = self._clock()

    def updated(self) -> None:
        with self._lock:
            self._last_updated = self._clock()
            self._oldest_queued = None

    def status(self) -> tuple[bool, float, float]:
        """(healthy, last updated, now)."""
        with self._lock:
            now = self._clock()
            stale = self._oldest_queued is not None and now - self._oldest_queued > self.timeout
            return not stale, self._last_updated, now


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
        if ":" in address[0]:
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


def serve_health(address: str, health: ProxyHealth, metrics: Metrics) -> _Server:
    def answer(check_node: bool, counter: object) -> Response:
        healthy, updated, now = health.status()
        eligible = not health.node_deleting
        ok = healthy and (eligible or not check_node)
        body: dict[str, object] = {"lastUpdated": _stamp(updated), "currentTime": _stamp(now)}
        if check_node:
            body["nodeEligible"] = eligible
        code = 200 if ok else 503
        counter.labels(code=str(code)).inc()  # type: ignore[attr-defined]
        return Response(code, "application/json", json.dumps(body).encode())

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
        healthy, _, _ = self._health.status()
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
