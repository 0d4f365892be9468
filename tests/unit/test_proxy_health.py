"""/healthz, /livez and the health-check node port servers, on host loopback (no netns)."""

from __future__ import annotations

import errno
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from email.message import Message
from typing import Any

import pytest

from proxyd import health
from proxyd.health import (
    PolicyHealth,
    ProxyHealth,
    ServiceHealthServers,
    serve_health,
    serve_metrics,
)
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
    probe = serve_health("127.0.0.1:0", ProxyHealth((4,), 60), Metrics())
    port = probe.server_address[1]
    probe.close()
    return port


def test_a_family_whose_queued_change_waits_past_the_timeout_makes_the_proxy_unhealthy() -> None:
    clock = Clock()
    health = ProxyHealth((4, 6), timeout=60, clock=clock)
    health.queued(frozenset({4, 6}))
    clock.now += 61
    assert health.status().healthy, "healthy while starting: no family synced yet"
    health.synced()
    health.queued(frozenset({6}))
    clock.now += 59
    assert health.status().healthy
    clock.now += 1
    status = health.status()
    assert not status.healthy
    assert status.families == {4: (True, 1061.0), 6: (False, 1061.0)}, (
        "IPv4 had no change queued: healthy without a sync since"
    )
    assert status.last_updated == 1061.0
    health.synced()
    assert health.status().healthy


def test_a_family_whose_sync_failed_turns_unhealthy_unless_a_later_sync_succeeds() -> None:
    clock = Clock()
    health = ProxyHealth((4, 6), timeout=60, clock=clock)
    health.synced()
    clock.now += 10
    health.synced(failed=frozenset({6}))
    clock.now += 59
    assert health.status().healthy
    clock.now += 1
    status = health.status()
    assert not status.healthy
    assert status.families == {4: (True, 1010.0), 6: (False, 1000.0)}
    health.synced(failed=frozenset({6}))
    assert not health.status().healthy, "a failed retry does not restart the wait"
    health.synced()
    assert health.status().families == {4: (True, 1070.0), 6: (True, 1070.0)}


def test_healthz_and_livez_answer_kube_proxys_json_and_only_healthz_minds_the_node() -> None:
    clock = Clock()
    health = ProxyHealth((4, 6), timeout=60, clock=clock)
    metrics = Metrics()
    server = serve_health("127.0.0.1:0", health, metrics)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        status, body, headers = get_with_headers(f"{base}/healthz")
        assert status == 200 and headers["X-Content-Type-Options"] == "nosniff"
        assert body == {
            "lastUpdated": "1970-01-01T00:16:40Z",
            "currentTime": "1970-01-01T00:16:40Z",
            "nodeEligible": True,
            "healthy": True,
        }
        health.synced()
        health.queued(frozenset({4, 6}))
        clock.now += 60
        health.synced(failed=frozenset({6}))
        status, body = get(f"{base}/livez")
        assert status == 503
        assert body == {
            "lastUpdated": "1970-01-01T00:17:40Z",
            "currentTime": "1970-01-01T00:17:40Z",
            "healthy": False,
            "status": {
                "IPv4": {"lastUpdated": "1970-01-01T00:17:40Z", "healthy": True},
                "IPv6": {"lastUpdated": "1970-01-01T00:16:40Z", "healthy": False},
            },
        }
        health.synced()
        health.node_deleting = True
        status, body = get(f"{base}/healthz")
        assert status == 503 and body["nodeEligible"] is False and body["healthy"] is True
        assert get(f"{base}/livez")[0] == 200
    finally:
        server.close()
    exposition = metrics.exposition()
    assert b'kubeproxy_proxy_healthz_total{code="503"} 1.0' in exposition
    assert b'kubeproxy_proxy_livez_total{code="503"} 1.0' in exposition


def test_failing_policy_makes_healthz_fail_and_leaves_livez_alone() -> None:
    """A table nft keeps refusing is no reason to restart the daemon (livez), but the node's
    health says it (healthz); a quarantine is contained and healthy."""
    policy = {
        4: PolicyHealth(True, 1000.0, 1),
        6: PolicyHealth(False, None, 0),
    }
    server = serve_health("127.0.0.1:0", ProxyHealth((4, 6), 60), Metrics(), lambda: policy)
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        status, body = get(f"{base}/healthz")
        assert status == 503 and body["healthy"] is True
        assert body["policy"] == {
            "IPv4": {"healthy": True, "lastUpdated": "1970-01-01T00:16:40Z", "quarantinedPods": 1},
            "IPv6": {"healthy": False, "lastUpdated": "0001-01-01T00:00:00Z", "quarantinedPods": 0},
        }
        status, body = get(f"{base}/livez")
        assert status == 200 and "policy" not in body
        policy[6] = PolicyHealth(True, 1000.0, 0)
        assert get(f"{base}/healthz")[0] == 200
    finally:
        server.close()


def test_health_check_node_port_counts_local_endpoints() -> None:
    servers = ServiceHealthServers(ProxyHealth((4,), timeout=60), bind_host="127.0.0.1")
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
    servers = ServiceHealthServers(ProxyHealth((4,), timeout=60))
    monkeypatch.setattr(socket, "socket", without_ipv6)
    try:
        servers.update({port: ("ns", "web", 1)})
        monkeypatch.undo()
        assert get(f"http://127.0.0.1:{port}/")[0] == 200
    finally:
        servers.close()


def idle_connection(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that sent half a request and waits."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: node\r\n")
    return sock


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed the connection (waiting up to the socket's timeout)."""
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_idle_connections_take_no_thread_and_close_at_the_request_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(health, "REQUEST_SECONDS", 0.5)
    server = serve_health("127.0.0.1:0", ProxyHealth((4,), 60), Metrics())
    port = server.server_address[1]
    threads = threading.active_count()
    idle = [idle_connection(port) for _ in range(50)]
    try:
        assert get(f"http://127.0.0.1:{port}/healthz")[0] == 200, "answered beside them"
        assert threading.active_count() == threads, "no thread per connection"
        start = time.monotonic()
        assert all(closed_by_server(sock) for sock in idle)
        assert time.monotonic() - start < 3
    finally:
        for sock in idle:
            sock.close()
        server.close()


def test_past_the_connection_cap_a_new_connection_closes_the_oldest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(health, "MAX_CONNECTIONS", 4)
    servers = ServiceHealthServers(ProxyHealth((4,), timeout=60), bind_host="127.0.0.1")
    port = free_port()
    servers.update({port: ("ns", "web", 1)})
    idle = [idle_connection(port) for _ in range(4)]
    try:
        for sock in idle:
            sock.settimeout(0.2)
        assert not any(closed_by_server(sock) for sock in idle), "within the cap: kept"
        assert get(f"http://127.0.0.1:{port}/")[0] == 200, "a real client, past the cap"
        assert closed_by_server(idle[0]), "the oldest made room"
        assert not any(closed_by_server(sock) for sock in idle[1:])
    finally:
        for sock in idle:
            sock.close()
        servers.close()


def test_a_flood_from_one_address_closes_its_own_connections_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pod flooding a health port cannot push out a load balancer's probe: past its own cap,
    or the loop's, the flooding address loses its oldest connection."""
    monkeypatch.setattr(health, "MAX_PER_SOURCE", 3)
    monkeypatch.setattr(health, "MAX_CONNECTIONS", 5)
    servers = ServiceHealthServers(ProxyHealth((4,), timeout=60), bind_host="127.0.0.1")
    port = free_port()
    servers.update({port: ("ns", "web", 1)})
    probe = idle_connection(port, "127.0.0.2")
    other = idle_connection(port, "127.0.0.3")
    flood = [idle_connection(port) for _ in range(3)]
    try:
        for sock in (probe, other, *flood):
            sock.settimeout(0.2)
        assert not any(closed_by_server(sock) for sock in (probe, other, *flood)), "5 of 5"
        flood.append(idle_connection(port))
        flood[-1].settimeout(0.2)
        assert closed_by_server(flood[0]), "past its own cap, the flood's oldest went"
        assert not closed_by_server(probe) and not closed_by_server(other)
        monkeypatch.setattr(health, "MAX_PER_SOURCE", 10)
        flood.append(idle_connection(port))
        flood[-1].settimeout(0.2)
        assert closed_by_server(flood[1]), "past the loop's cap, the biggest holder's oldest"
        assert not closed_by_server(probe) and not closed_by_server(other)
        probe.sendall(b"\r\n")
        assert probe.recv(12) == b"HTTP/1.1 200", "the oldest connection of all is answered"
    finally:
        for sock in (probe, other, *flood):
            sock.close()
        servers.close()


def test_a_metrics_scrape_reading_the_kernel_does_not_hold_healthz_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """/metrics reads the policy's counters from the kernel; healthz and the health-check
    node ports are answered meanwhile, from a loop of their own."""
    entered, release = threading.Event(), threading.Event()

    def blocked_exposition() -> bytes:
        entered.set()
        release.wait(10)
        return b""

    metrics = Metrics()
    monkeypatch.setattr(metrics, "exposition", blocked_exposition)
    scraped = serve_metrics("127.0.0.1:0", metrics, "iptables")
    probed = serve_health("127.0.0.1:0", ProxyHealth((4,), 60), Metrics())
    scrape = threading.Thread(
        target=urllib.request.urlopen,
        args=(f"http://127.0.0.1:{scraped.server_address[1]}/metrics",),
    )
    try:
        scrape.start()
        assert entered.wait(5)
        with urllib.request.urlopen(
            f"http://127.0.0.1:{probed.server_address[1]}/healthz", timeout=2
        ) as answer:
            assert answer.status == 200
    finally:
        release.set()
        scrape.join()
        scraped.close()
        probed.close()


def test_a_request_head_past_the_bound_is_refused() -> None:
    server = serve_health("127.0.0.1:0", ProxyHealth((4,), 60), Metrics())
    try:
        with socket.create_connection(("127.0.0.1", server.server_address[1]), timeout=5) as sock:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nX-Filler: " + b"a" * 10_000)
            assert sock.recv(100).startswith(b"HTTP/1.1 431 ")
    finally:
        server.close()
