"""knit-proxyd's life on a node: restart without disruption, API outages, clean-ups."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from deploy.lab.controlplane import ControlPlane
from deploy.lab.held import HeldConnection
from deploy.lab.kube import SERVICES, SLICES, Kube, endpoint, service_object, slice_object
from deploy.lab.netns import Netns
from deploy.lab.process import checkout_path, eventually
from deploy.lab.relay import NetnsForward
from proxyd.iptables.chains import owned_by_knit
from tests.support.cni_env import UPLINK_NODE
from tests.support.proxy_env import (
    ProxyNode,
    running_proxy_node,
)

HTTP = [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}]
SLICE_HTTP = [{"name": "http", "port": 8080, "protocol": "TCP"}]


@pytest.fixture(scope="module")
def backend(proxy_node: ProxyNode) -> Any:
    return proxy_node.add_pod("backend", (8080, "tcp"))


def make_service(kube: Kube, proxy_node: ProxyNode, backend: Any, name: str) -> str:
    svc = kube.create(SERVICES, service_object(name, HTTP))
    kube.create(
        SLICES, slice_object(name, [endpoint(backend.address(), proxy_node.name)], SLICE_HTTP)
    )
    return svc["spec"]["clusterIP"]


def test_restart_adopts_rules_and_keeps_established_connections(
    proxy_node: ProxyNode, backend: Any, kube: Kube
) -> None:
    ip = make_service(kube, proxy_node, backend, "held")
    client = proxy_node.add_pod("held-client")
    eventually(lambda: client.ns.exchange(ip, 80))
    with HeldConnection(client.ns.name, ip, 80) as held:
        assert held.greeting.split()[1] == "backend"
        proxy_node.stop()
        assert f"-d {ip}/32" in proxy_node.iptables(), "stopping leaves the rules in place"
        proxy_node.start()
        assert f"-d {ip}/32" in proxy_node.iptables()
        assert held.exchange("still there")


def test_api_outage_keeps_rules_and_recovers(
    proxy_node: ProxyNode, backend: Any, kube: Kube
) -> None:
    ip = make_service(kube, proxy_node, backend, "steady")
    client = proxy_node.add_pod("outage-client")
    eventually(lambda: client.ns.exchange(ip, 80))

    def watch_failures() -> int:
        return proxy_node.log_path.read_text(errors="replace").count("Service list/watch failed")

    failed_before = watch_failures()
    forward = proxy_node.forward
    forward.stop()
    try:
        eventually(lambda: watch_failures() > failed_before, what="the daemon losing the API")
        later = make_service(kube, proxy_node, backend, "during-outage")
        assert client.ns.exchange(ip, 80)[1] == "backend", "rules stay while the API is away"
        assert f"-d {later}/32" not in proxy_node.iptables()
    finally:
        proxy_node.forward = NetnsForward(proxy_node.ns.name, forward.target_port)
    assert eventually(lambda: client.ns.exchange(later, 80), timeout=60)[1] == "backend"


def test_conntrack_timeouts_are_kube_proxys_defaults(proxy_node: ProxyNode) -> None:
    def timeouts() -> dict[str, str]:
        names = ("tcp_timeout_established", "tcp_timeout_close_wait")
        return {
            name: proxy_node.ns.run(
                "cat", f"/proc/sys/net/netfilter/nf_conntrack_{name}"
            ).stdout.strip()
            for name in names
        }

    expected = {"tcp_timeout_established": "86400", "tcp_timeout_close_wait": "3600"}
    eventually(lambda: timeouts() == expected, what=f"{expected}, not {timeouts()}")


def test_healthz_fails_while_the_autoscaler_is_deleting_the_node(
    proxy_node: ProxyNode, kube: Kube
) -> None:
    node_path = f"/api/v1/nodes/{proxy_node.name}"
    taint = {"key": "ToBeDeletedByClusterAutoscaler", "value": "1", "effect": "NoSchedule"}
    healthz = "http://127.0.0.1:10256/healthz"

    def refused_body() -> str | None:
        status, body = proxy_node.http(healthz)
        return body if status == 503 else None

    kube.patch(node_path, {"spec": {"taints": [taint]}})
    try:
        assert '"nodeEligible": false' in eventually(refused_body)
        assert proxy_node.http("http://127.0.0.1:10256/livez")[0] == 200
    finally:
        kube.patch(node_path, {"spec": {"taints": None}})
    eventually(lambda: proxy_node.http(healthz)[0] == 200)


def test_cleanup_removes_what_the_proxy_installed_and_nothing_else(
    proxy_node: ProxyNode, backend: Any, kube: Kube
) -> None:
    make_service(kube, proxy_node, backend, "to-clean")
    eventually(lambda: "KNIT-SVC-" in proxy_node.iptables())
    proxy_node.ns.run("iptables", "-t", "nat", "-N", "KNIT-MASQ-0123456789ab")
    try:
        proxy_node.stop()
        proxy_node.ns.run(
            sys.executable, "-m", "proxyd", "--cleanup", env={**os.environ, **checkout_path()}
        )
        for table in ("nat", "filter"):
            for family in (4, 6):
                chains = re.findall(r"^:(\S+)", proxy_node.iptables(table, family), re.MULTILINE)
                assert not [c for c in chains if owned_by_knit(c)], (table, family, chains)
        assert "knit" not in proxy_node.ns.run("nft", "list", "tables").stdout
        assert "KNIT-MASQ-0123456789ab" in proxy_node.iptables(), "the CNI plugin's chain stays"
    finally:
        proxy_node.ns.run("iptables", "-t", "nat", "-X", "KNIT-MASQ-0123456789ab", check=False)
        proxy_node.start()


def test_cleanup_kube_proxy_removes_its_leftovers(proxy_node: ProxyNode) -> None:
    leftovers = (
        "*nat\n:KUBE-SERVICES - [0:0]\n:KUBE-SVC-ABC - [0:0]\n:KUBE-MARK-MASQ - [0:0]\n"
        ":KUBE-KUBELET-CANARY - [0:0]\n"
        '-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES\n'
        "-A KUBE-SERVICES -d 10.96.0.1/32 -p tcp -m tcp --dport 443 -j KUBE-SVC-ABC\n"
        "-A KUBE-SVC-ABC -j KUBE-MARK-MASQ\nCOMMIT\n"
    )
    proxy_node.ns.run("iptables-restore", "--noflush", stdin=leftovers)
    proxy_node.ns.run("nft", "add table ip kube-proxy; add chain ip kube-proxy services")
    try:
        proxy_node.restart("--cleanup-kube-proxy")
        assert "kube-proxy" not in proxy_node.ns.run("nft", "list", "tables").stdout
        rules = proxy_node.iptables()
        assert "KUBE-SERVICES" not in rules and "KUBE-SVC-ABC" not in rules
        assert "KUBE-KUBELET-CANARY" in rules, "kubelet's chains are not kube-proxy's"
        assert "KNIT-SERVICES" in rules
    finally:
        proxy_node.ns.run("iptables", "-t", "nat", "-X", "KUBE-KUBELET-CANARY", check=False)
        proxy_node.restart()


@pytest.mark.skipif(
    not Path("/proc/net/ip_vs").exists(),
    reason="this kernel has no IPVS (CONFIG_IP_VS off); the VM node runs this test (tests/vm)",
)
def test_ipvs_mode_restart_keeps_connections_and_cleanup_removes_all_it_made(
    control_plane: ControlPlane,
    make_netns: Callable[[str], Netns],
    tmp_path: Path,
    kube: Kube,
) -> None:
    """Stopped, the IPVS mode leaves the kernel serving; started again, its full sync adopts
    the virtual servers without breaking a held connection; `--cleanup` then removes its
    virtual servers, dummy link, sets and chains."""
    node_ns = make_netns("ipvs-node")
    with running_proxy_node(control_plane, kube, node_ns, make_netns, tmp_path, "ipvs") as proxy:
        backend = proxy.add_pod("ipvs-backend", (8080, "tcp"))
        ip = make_service(kube, proxy, backend, "ipvs-held")
        client = proxy.add_pod("ipvs-client")
        eventually(lambda: client.ns.exchange(ip, 80))
        with HeldConnection(client.ns.name, ip, 80) as held:
            proxy.stop()
            assert f"{ip} TCP 80" in proxy.rules(), "stopping leaves the virtual server in place"
            assert held.exchange("while stopped")
            proxy.start()
            assert held.exchange("after the restart's full sync")
            assert client.ns.exchange(ip, 80), "and new connections are served"
        proxy.stop()
        proxy.ns.run(
            sys.executable, "-m", "proxyd", "--cleanup", env={**os.environ, **checkout_path()}
        )
        left = proxy.rules()
        assert ip not in left and "KNIT" not in left, left
        assert "knit-ipvs0" not in proxy.ns.run("ip", "link").stdout
        assert not client.ns.reaches(ip, 80), "nothing serves the address any more"


def test_the_node_iptables_flavour_is_followed(
    control_plane: ControlPlane,
    make_netns: Callable[[str], Netns],
    tmp_path: Path,
    kube: Kube,
) -> None:
    """A node whose rules live in legacy xtables gets the proxy's rules there too."""
    node_ns = make_netns("legacy-node")
    for _ in range(3):
        node_ns.run("iptables-legacy", "-A", "INPUT", "-j", "ACCEPT")
    with running_proxy_node(control_plane, kube, node_ns, make_netns, tmp_path):
        assert "KNIT-SERVICES" in node_ns.run("iptables-legacy-save", "-t", "nat").stdout
        assert "KNIT-SERVICES" not in node_ns.run("iptables-nft-save", "-t", "nat").stdout


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_localhost_node_ports_turned_off_leave_loopback_unserved(
    proxy_node: ProxyNode, backend: Any, kube: Kube, mode: str
) -> None:
    name = f"no-localhost-{mode}"
    svc = kube.create(SERVICES, service_object(name, HTTP, type="NodePort"))
    kube.create(
        SLICES, slice_object(name, [endpoint(backend.address(), proxy_node.name)], SLICE_HTTP)
    )
    node_port = svc["spec"]["ports"][0]["nodePort"]
    assert eventually(lambda: proxy_node.ns.exchange("127.0.0.1", node_port))[1] == "backend"
    try:
        proxy_node.stop()
        proxy_node.mode = mode
        proxy_node.start("--iptables-localhost-nodeports", "false")
        assert proxy_node.outside.exchange(UPLINK_NODE, node_port)[1] == "backend"
        assert not proxy_node.ns.reaches("127.0.0.1", node_port)
    finally:
        proxy_node.stop()
        proxy_node.mode = "iptables"
        proxy_node.start()
    assert proxy_node.ns.exchange("127.0.0.1", node_port)[1] == "backend"


def test_switching_to_nftables_and_back_replaces_the_rules_and_adopts_the_table(
    proxy_node: ProxyNode, backend: Any, kube: Kube
) -> None:
    ip = make_service(kube, proxy_node, backend, "switch")
    gone = make_service(kube, proxy_node, backend, "switch-gone")
    client = proxy_node.add_pod("switch-client")
    eventually(lambda: client.ns.exchange(ip, 80))
    try:
        proxy_node.stop()
        proxy_node.mode = "nftables"
        proxy_node.start()
        # once the nftables mode's rules are in: until then the iptables mode's serve
        eventually(lambda: "KNIT-SERVICES" not in proxy_node.iptables(), 10)
        assert f"{gone} . tcp . 80" in proxy_node.rules()
        assert client.ns.exchange(ip, 80)[1] == "backend"
        proxy_node.stop()
        kube.delete(f"{SERVICES}/switch-gone")
        proxy_node.start()
        rules = proxy_node.rules()
        assert f"{ip} . tcp . 80" in rules
        assert f"{gone} . tcp . 80" not in rules, "a restart's full sync removes stale elements"
        assert client.ns.exchange(ip, 80)[1] == "backend"
    finally:
        proxy_node.stop()
        proxy_node.mode = "iptables"
        proxy_node.start()
    eventually(
        lambda: proxy_node.ns.run("nft", "list", "table", "ip", "knit", check=False).returncode,
        10,
        what="the nftables mode's table gone",
    )
    assert f"-d {ip}/32" in proxy_node.iptables()
    assert client.ns.exchange(ip, 80)[1] == "backend"
