"""/healthz, /livez and the health-check node port servers, on host loopback (no netns)."""

from __future__ import annotations

import errno
import json
import socket
import urllib.error
import urllib.request
from email.message import Message
from typing import Any

import pytest

from proxyd.health import ProxyHealth, ServiceHealthServers, serve_health
from proxyd.metrics import Metrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def get(url: str) -> tuple[int, dict[str, object]]:
    return get_with_headers(url)[:2]


def get_with_headers(url: str) -> tuple[int, dict[str, object], Message]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read()), err.headers


def free_port() -> int:
    probe = serve_health("127.0.0.1:0", ProxyHealth(60), Metrics())
    port = probe.server_address[1]
    probe.shutdown()
    probe.server_close()
    return port


def test_a_change_left_unsynced_past_the_timeout_makes_the_proxy_unhealthy() -> None:
    clock = Clock()
    health = ProxyHealth(timeout=60, clock=clock)
    assert health.status()[0]
    health.queued()
    clock.now += 59
    assert health.status()[0]
    clock.now += 2
    assert not health.status()[0]
    health.updated()
    assert health.status()[0]


def test_healthz_reports_node_deletion_and_livez_does_not() -> None:
    health = ProxyHealth(timeout=60)
    metrics = Metrics()
    server = serve_health("127.0.0.1:0", health, metrics)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        status, body = get(f"{base}/healthz")
        assert status == 200 and {"lastUpdated", "currentTime"} <= body.keys()
        health.node_deleting = True
        assert get(f"{base}/healthz")[0] == 503
        assert get(f"{base}/livez")[0] == 200
    finally:
        server.shutdown()
        server.server_close()
    assert b'kubeproxy_proxy_healthz_total{code="503"} 1.0' in metrics.exposition()


def test_health_check_node_port_counts_local_endpoints() -> None:
    servers = ServiceHealthServers(ProxyHealth(timeout=60), bind_host="127.0.0.1")
    port = free_port()
    try:
        servers.update({port: ("ns", "web", 2)})
        status, body, headers = get_with_headers(f"http://127.0.0.1:{port}/")
        assert status == 200 and headers["X-Load-Balancing-Endpoint-Weight"] == "2"
        assert body == {
            "service": {"namespace": "ns", "name": "web"},
            "localEndpoints": 2,
            "serviceProxyHealthy": True,
        }
        servers.update({port: ("ns", "web", 0)})
        assert get(f"http://127.0.0.1:{port}/")[0] == 503
    finally:
        servers.close()


def test_health_check_node_ports_fall_back_to_ipv4_on_a_node_without_ipv6(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_socket = socket.socket

    def without_ipv6(family: int = socket.AF_INET, *args: Any, **kwargs: Any) -> socket.socket:
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        return real_socket(family, *args, **kwargs)

    port = free_port()
    servers = ServiceHealthServers(ProxyHealth(timeout=60))
    monkeypatch.setattr(socket, "socket", without_ipv6)
    try:
        servers.update({port: ("ns", "web", 1)})
        monkeypatch.undo()
        assert get(f"http://127.0.0.1:{port}/")[0] == 200
    finally:
        servers.close()
