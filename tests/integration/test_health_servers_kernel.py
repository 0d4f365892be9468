"""knit-proxyd's healthz, metrics and health-check node port servers under idle connections.

Every pod reaches a node's healthz port and its health-check node ports. A connection that
opens and sends half a request, then waits, must cost the daemon no thread, and must not keep
a real client (kubelet's probe, a load balancer's check) waiting or the proxy from syncing.

The number of idle connections is KNIT_IDLE_CONNECTIONS (3,000 unless set; 20,000 was
measured once, see docs/proxy.md#health).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from deploy.lab.kube import SERVICES, SLICES, Kube, endpoint, service_object, slice_object
from deploy.lab.netns import Netns
from deploy.lab.process import eventually
from tests.support.proxy_env import LAST_SYNC, ProxyNode

IDLE_CONNECTIONS = int(os.environ.get("KNIT_IDLE_CONNECTIONS", "3000"))
HALF_A_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: node\r\n"
HTTP = {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}
SLICE_HTTP = [{"name": "http", "port": 8080, "protocol": "TCP"}]


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


HOLDER = f"""
import resource, socket, sys
ports = [int(port) for port in sys.argv[1].split(",")]
_, most = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (most, most))
held, connected = [], 0
for index in range(int(sys.argv[2])):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held.append(sock)
    sock.settimeout(2)
    try:
        sock.connect(("127.0.0.1", ports[index % len(ports)]))
        sock.sendall({HALF_A_REQUEST!r})
        connected += 1
    except OSError:  # a server at its bound may close or leave waiting what it cannot take
        pass
print(connected, flush=True)
sys.stdin.read()
"""
"""Opens argv[2] connections over 127.0.0.1:argv[1] with half a request each, prints how many
connected, and holds them until its stdin closes."""
PER_HOLDER = 5000
"""Connections per holder process, within one process's descriptor limit."""


@contextlib.contextmanager
def idle_connections(ns: Netns, ports: list[int], count: int) -> Iterator[int]:
    """`count` idle connections to ports in ns, held by processes of their own (the
    descriptors a test process may have run short); yields how many connected."""
    holders: list[subprocess.Popen[str]] = []
    try:
        for first in range(0, count, PER_HOLDER):
            argv = ",".join(map(str, ports)), str(min(PER_HOLDER, count - first))
            holders.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns.name, sys.executable, "-c", HOLDER, *argv],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
            )
        yield sum(int(holder.stdout.readline()) for holder in holders if holder.stdout)
    finally:
        for holder in holders:
            holder.communicate(timeout=60)


def timed_get(ns: Netns, url: str) -> tuple[int, float]:
    """(status, seconds) of a GET made from inside ns."""
    start = time.monotonic()
    with ns.entered():
        try:
            with urllib.request.urlopen(url, timeout=30) as response:
                status = response.status
        except urllib.error.HTTPError as err:
            status = err.code
    return status, time.monotonic() - start


def sync_seconds(proxy_node: ProxyNode, kube: Kube, slice_name: str, address: str) -> float:
    """How long a change to the slice takes to be synced."""
    start = time.time()
    kube.patch(f"{SLICES}/{slice_name}", {"endpoints": [endpoint(address, proxy_node.name)]})
    eventually(
        lambda: proxy_node.metric(LAST_SYNC, 'ip_family="IPv4"') > start,
        what="a sync after the change",
        timeout=60,
        interval=0.05,
    )
    return time.time() - start


@pytest.fixture
def health_check_port(proxy_node: ProxyNode, kube: Kube) -> Iterator[int]:
    """The health-check node port of a Service with externalTrafficPolicy Local and one local
    endpoint, answering 200."""
    svc: dict[str, Any] = kube.create(
        SERVICES,
        service_object("idle-checks", [HTTP], type="LoadBalancer", externalTrafficPolicy="Local"),
    )
    kube.create(
        SLICES, slice_object("idle-checks", [endpoint("10.244.1.50", proxy_node.name)], SLICE_HTTP)
    )
    port = int(svc["spec"]["healthCheckNodePort"])
    eventually(lambda: proxy_node.http(f"http://127.0.0.1:{port}/")[0] == 200)
    yield port


def test_idle_connections_cost_no_thread_nor_a_real_clients_answer_nor_a_sync(
    proxy_node: ProxyNode, kube: Kube, health_check_port: int
) -> None:
    assert proxy_node.process is not None
    pid = proxy_node.process.pid
    ns = proxy_node.ns
    healthz = "http://127.0.0.1:10256/healthz"
    sync_before = sync_seconds(proxy_node, kube, "idle-checks-ipv4", "10.244.1.51")
    threads_before = thread_count(pid)
    with idle_connections(ns, [10256, 10249, health_check_port], IDLE_CONNECTIONS) as connected:
        time.sleep(1)  # what a thread per connection would have started by now
        threads_idle = thread_count(pid)
        status, answer_seconds = timed_get(ns, healthz)
        check_status, check_seconds = timed_get(ns, f"http://127.0.0.1:{health_check_port}/")
        sync_idle = sync_seconds(proxy_node, kube, "idle-checks-ipv4", "10.244.1.52")
        threads_after_sync = thread_count(pid)
    print(
        f"\n{IDLE_CONNECTIONS} idle connections ({connected} connected): threads {threads_before}"
        f" -> {threads_idle} (after a sync {threads_after_sync}); /healthz {status} in"
        f" {answer_seconds * 1000:.0f} ms, health check {check_status} in"
        f" {check_seconds * 1000:.0f} ms; a sync took {sync_before * 1000:.0f} ms before,"
        f" {sync_idle * 1000:.0f} ms with them"
    )
    assert threads_idle <= threads_before and threads_after_sync <= threads_before
    assert status == 200 and answer_seconds < 1.0
    assert check_status == 200 and check_seconds < 1.0
    assert sync_idle < max(2.0, 3 * sync_before)
