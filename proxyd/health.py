"""HTTP endpoints: /healthz and /livez (kube-proxy's semantics), /metrics and /proxyMode, and
one health-check server per healthCheckNodePort of externalTrafficPolicy Local services."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], routes: dict[str, Callable[[], Response]]) -> None:
        self.routes = routes
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


Response = tuple[int, str, bytes]
"""(status, content type, body)."""


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:
        routes = self.server.routes
        route = routes.get(self.path.split("?", 1)[0]) or routes.get("*")
        status, content_type, body = route() if route else (404, "text/plain", b"not found\n")
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

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
        return code, "application/json", json.dumps(body).encode()

    routes = {
        "/healthz": lambda: answer(True, metrics.healthz),
        "/livez": lambda: answer(False, metrics.livez),
    }
    return _start(_Server(split_address(address), routes), "healthz")


def serve_metrics(address: str, metrics: Metrics, mode: str) -> _Server:
    routes: dict[str, Callable[[], Response]] = {
        "/metrics": lambda: (200, "text/plain; version=0.0.4", metrics.exposition()),
        "/proxyMode": lambda: (200, "text/plain", mode.encode()),
        "/healthz": lambda: (200, "text/plain", b"ok"),
    }
    return _start(_Server(split_address(address), routes), "metrics")


class ServiceHealthServers:
    """One HTTP server per healthCheckNodePort, answering with the local endpoint count."""

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
        return code, "application/json", json.dumps(body).encode()

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
                server = _Server(
                    (self._bind_host, port),
                    {"*": lambda port=port: self._answer(port)},
                )
            except OSError as err:
                log.error("cannot serve health check node port %d: %s", port, err)
                continue
            self._servers[port] = _start(server, f"health-{port}")

    def close(self) -> None:
        self.update({})
