"""Service behaviours through every datapath of knit-proxyd, each shown by real packets.

The whole module runs once per proxy mode (the `proxy_mode` fixture), so the modes cannot
drift apart; IPVS runs only where the kernel has it (not on this development machine).

One node namespace runs the daemon against the real API server; backend and client pods are
attached to it through the CNI plugin; an outside namespace plays an external client. An
endpoint is "remote" when its EndpointSlice names another node (the pod is still reachable
from here, so only the proxy's choice decides where traffic goes).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from deploy.lab.kube import (
    NODES,
    SERVICES,
    SLICES,
    Kube,
    endpoint,
    slice_object,
)
from deploy.lab.netns import ECHO
from deploy.lab.process import eventually
from proxyd.model import ZONE_LABEL
from proxyd.nftables.render import UNDECLARED_PORTS_CHECK
from tests.support.cni_env import UPLINK_NODE, UPLINK_OUTSIDE
from tests.support.proxy_env import (
    HTTP,
    REMOTE_NODE,
    SLICE_HTTP,
    ProxyNode,
    create_service,
)

GATEWAY = "10.244.1.1"
GATEWAY6 = "fd10:244:1::1"


def create_backed(
    kube: Kube,
    name: str,
    ports: list[dict[str, Any]] | None = None,
    *,
    endpoints: list[dict[str, Any]],
    slice_ports: list[dict[str, Any]] | None = None,
    **spec: Any,
) -> dict[str, Any]:
    """A Service and its IPv4 EndpointSlice."""
    service = create_service(kube, name, ports, **spec)
    kube.create(SLICES, slice_object(name, endpoints, slice_ports or SLICE_HTTP))
    return service


IPVS_IN_KERNEL = Path("/proc/net/ip_vs").exists()
SCTP_SOCKETS = "SCTP" in Path("/proc/net/protocols").read_text()


@pytest.fixture(
    scope="module",
    params=[
        "iptables",
        "nftables",
        pytest.param(
            "ipvs",
            marks=pytest.mark.skipif(
                not IPVS_IN_KERNEL,
                reason="this kernel has no IPVS (CONFIG_IP_VS off); "
                "the kind CI workflow runs this mode",
            ),
        ),
    ],
)
def proxy_mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def firewall_drops(proxy_node: ProxyNode, lb_ip: str) -> int:
    """Packets the loadBalancerSourceRanges firewall dropped on their way to lb_ip."""
    if proxy_node.mode == "nftables":
        listing = proxy_node.ns.run("nft", "list", "table", "ip", "knit").stdout
        firewall_map = re.split(r"map firewall-ips(?:-1)? \{", listing, maxsplit=1)[1]
        chain = firewall_map.split(f"{lb_ip} . tcp . 80 : goto ", 1)[1].split()[0].rstrip(",}")
        rules = listing.split(f"chain {chain} {{", 1)[1].split("\n\t}", 1)[0]
        return int(rules.split("counter packets ", 1)[1].split()[0])
    if proxy_node.mode == "ipvs":
        listing = proxy_node.ns.run(
            "iptables", "-t", "filter", "-L", "KNIT-IPVS-SOURCE-RANGES", "-v", "-n", "-x"
        )
        return sum(int(line.split()[0]) for line in listing.stdout.splitlines() if "DROP" in line)
    listing = proxy_node.ns.run(
        "iptables", "-t", "filter", "-L", "KNIT-PROXY-FIREWALL", "-v", "-n", "-x"
    )
    return sum(int(line.split()[0]) for line in listing.stdout.splitlines() if lb_ip in line)


def ipvs_frontend(proxy_node: ProxyNode, proto: str, ip: str, port: int) -> bool:
    """Whether the IPVS mode holds a virtual server for (ip, proto, port)."""
    return f"ipvs {ip} {proto} {port} ".lower() in proxy_node.rules().lower()


def dnat_to(proxy_node: ProxyNode, proto: str, ip: str, port: int, target: str) -> bool:
    """Whether the datapath sends (ip, proto, port) to target (ip:port); in the IPVS mode,
    whether it holds the frontend."""
    if proxy_node.mode == "ipvs":
        return ipvs_frontend(proxy_node, proto, ip, port)
    rules = proxy_node.rules()
    if proxy_node.mode == "nftables":
        address, target_port = target.rsplit(":", 1)
        endpoint = f"{ip} . {port} . 0 : {address} . {target_port}"
        return f"{ip} . {proto} . {port}" in rules and endpoint in rules
    lines = rules.splitlines()
    return any(f"-d {ip}/32 -p {proto}" in line for line in lines) and any(
        f"-p {proto}" in line and f"DNAT --to-destination {target}" in line for line in lines
    )


IPVS_ONE_SET = (
    "IPVS gives a frontend one set of real servers whoever sends: under a Local policy, pods "
    "too reach an external frontend's local endpoints only, as in kube-proxy's IPVS mode"
)

AFFINITY_SHORT_TIMEOUT = 2
"""timeoutSeconds short enough to wait out, long enough for back-to-back connections to stick."""

AFFINITY_SIGN = {
    "iptables": "--rcheck --seconds 5 --reap",
    "nftables": "timeout 5s",
    "ipvs": "timeout=5",
}


def backends_seen(client: Any, host: str, port: int, tries: int, proto: str = "tcp") -> set[str]:
    return {client.exchange(host, port, proto)[1] for _ in range(tries)}


def connect_outcome(ns: Any, host: str, port: int, source_port: int = 0, timeout: float = 3) -> str:
    """ "open", "refused" at once (an ICMP reject), "timeout" after `timeout` s, or the error;
    from `source_port` when given."""
    result = ns.run(
        sys.executable,
        "-c",
        "import socket,sys\n"
        f"s=socket.socket(); s.settimeout({timeout})\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        f"s.bind(('', {source_port}))\n"
        f"try:\n s.connect(({host!r},{port})); print('open')\n"
        "except ConnectionRefusedError: print('refused')\n"
        "except OSError as e: print('timeout' if isinstance(e, TimeoutError) else e)\n",
        check=False,
    )
    return str(result.stdout.strip())


def refused(ns: Any, host: str, port: int) -> bool:
    return connect_outcome(ns, host, port) == "refused"


@pytest.fixture(scope="module")
def pods(proxy_node: ProxyNode) -> dict[str, Any]:
    ports = ((8080, "tcp"), (8080, "udp"), (9090, "tcp"))
    return {
        "a": proxy_node.add_pod("backend-a", *ports),
        "b": proxy_node.add_pod("backend-b", *ports),
        "client": proxy_node.add_pod("client"),
    }


def test_cluster_ip_tcp_and_udp_spread_and_keep_the_pod_source(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_service(
        kube, "spread", [HTTP, {"name": "dns", "port": 53, "targetPort": 8080, "protocol": "UDP"}]
    )
    kube.create(
        SLICES,
        slice_object(
            "spread",
            [
                endpoint(pods["a"].address(), proxy_node.name),
                endpoint(pods["b"].address(), REMOTE_NODE),
            ],
            [*SLICE_HTTP, {"name": "dns", "port": 8080, "protocol": "UDP"}],
        ),
    )
    ip = svc["spec"]["clusterIP"]
    client = pods["client"].ns
    source, _ = eventually(lambda: client.exchange(ip, 80))
    assert source == pods["client"].address(), "a pod client keeps its source address"
    assert backends_seen(client, ip, 80, 16) == {"backend-a", "backend-b"}
    assert eventually(lambda: client.exchange(ip, 53, "udp"))[1] in {"backend-a", "backend-b"}


def test_sctp_service_reaches_the_kernel_and_carries_where_sctp_exists(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    """The rules everywhere; an association only on a kernel with SCTP sockets (the VM node's:
    the development kernel has none)."""
    svc = create_service(kube, "sctp", [{"name": "s", "port": 7777, "protocol": "SCTP"}])
    kube.create(
        SLICES,
        slice_object(
            "sctp",
            [endpoint(pods["a"].address(), proxy_node.name)],
            [{"name": "s", "port": 7777, "protocol": "SCTP"}],
        ),
    )
    ip = svc["spec"]["clusterIP"]
    eventually(lambda: dnat_to(proxy_node, "sctp", ip, 7777, f"{pods['a'].address()}:7777"))
    if SCTP_SOCKETS:
        pods["a"].ns.serve("0.0.0.0", 7777, "sctp", "backend-a")
        client = pods["client"].ns
        assert eventually(lambda: client.exchange(ip, 7777, "sctp"))[1] == "backend-a"


def test_named_ports_use_the_slice_port_of_the_same_name(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_service(
        kube,
        "named",
        [HTTP, {"name": "admin", "port": 81, "targetPort": "admin-port", "protocol": "TCP"}],
    )
    kube.create(
        SLICES,
        slice_object(
            "named",
            [endpoint(pods["a"].address(), proxy_node.name)],
            [*SLICE_HTTP, {"name": "admin", "port": 9090, "protocol": "TCP"}],
        ),
    )
    ip = svc["spec"]["clusterIP"]
    client = pods["client"].ns
    assert eventually(lambda: client.exchange(ip, 81))[1] == "backend-a"
    assert client.exchange(ip, 80)[1] == "backend-a"


def test_no_endpoints_is_rejected_at_once(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_service(kube, "empty", type="NodePort")
    ip = svc["spec"]["clusterIP"]
    node_port = svc["spec"]["ports"][0]["nodePort"]
    assert eventually(lambda: refused(pods["client"].ns, ip, 80))
    assert eventually(lambda: refused(proxy_node.outside, UPLINK_NODE, node_port))


def test_nftables_mode_refuses_a_port_the_service_does_not_declare(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    if proxy_node.mode != "nftables":
        pytest.skip("kube-proxy's iptables and IPVS modes route such a connection on")
    svc = create_backed(
        kube, "declared", endpoints=[endpoint(pods["a"].address(), proxy_node.name)]
    )
    ip = svc["spec"]["clusterIP"]
    assert eventually(lambda: pods["client"].ns.exchange(ip, 80))[1] == "backend-a"
    assert eventually(lambda: proxy_node.ns.exchange(ip, 80))[1] == "backend-a", (
        "the node's own connection to a declared port is DNATed before the check"
    )
    assert refused(pods["client"].ns, ip, 81), "from a pod"
    assert refused(proxy_node.ns, ip, 81), "from the node"


UNALLOCATED_CLUSTER_IP = "10.96.255.254"
"""In the API server's default ServiceCIDR (10.96.0.0/16); no Service holds it."""


def test_nftables_mode_drops_what_goes_to_an_address_of_the_service_cidr_no_service_holds(
    proxy_node: ProxyNode,
) -> None:
    """A host outside owns an address of the service range: the iptables and IPVS modes route
    the node's connection there, as kube-proxy's do; the nftables mode drops it, as
    kube-proxy's does, from the ranges of the ServiceCIDR objects."""
    outside = proxy_node.outside
    outside.run("ip", "address", "add", f"{UNALLOCATED_CLUSTER_IP}/32", "dev", "lo")
    outside.serve(UNALLOCATED_CLUSTER_IP, 8088, "tcp", "outside")
    try:
        outcome = connect_outcome(proxy_node.ns, UNALLOCATED_CLUSTER_IP, 8088)
        assert outcome == ("timeout" if proxy_node.mode == "nftables" else "open")
        if proxy_node.mode == "nftables":
            listing = proxy_node.ns.run(
                "nft", "list", "chain", "ip", "knit", UNDECLARED_PORTS_CHECK
            )
            assert "ip daddr 10.96.0.0/16 drop" in listing.stdout
    finally:
        outside.run("ip", "address", "del", f"{UNALLOCATED_CLUSTER_IP}/32", "dev", "lo")


def test_node_port_from_outside_is_masqueraded_and_nodeport_addresses_restrict_it(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_backed(
        kube, "np", type="NodePort", endpoints=[endpoint(pods["a"].address(), proxy_node.name)]
    )
    node_port = svc["spec"]["ports"][0]["nodePort"]
    outside = proxy_node.outside
    source, backend = eventually(lambda: outside.exchange(UPLINK_NODE, node_port))
    assert backend == "backend-a"
    assert source == GATEWAY, "eTP Cluster traffic from outside is masqueraded"
    assert pods["client"].ns.exchange(GATEWAY, node_port)[1] == "backend-a"
    if proxy_node.mode != "ipvs":  # IPVS serves no NodePort on loopback (docs/proxy-ipvs.md)
        assert proxy_node.ns.exchange("127.0.0.1", node_port)[1] == "backend-a", "localhost"
    dual = create_service(
        kube,
        "np-dual",
        type="NodePort",
        ipFamilyPolicy="RequireDualStack",
        ipFamilies=["IPv4", "IPv6"],
    )
    kube.create(
        SLICES,
        slice_object(
            "np-dual",
            [endpoint(pods["b"].address(6), proxy_node.name)],
            SLICE_HTTP,
            address_type="IPv6",
        ),
    )
    dual_port = dual["spec"]["ports"][0]["nodePort"]
    assert eventually(lambda: pods["client"].ns.exchange(GATEWAY6, dual_port))[1] == "backend-b"
    try:
        proxy_node.restart("--nodeport-addresses", "198.18.0.0/24")
        assert eventually(lambda: outside.exchange(UPLINK_NODE, node_port))[1] == "backend-a"
        assert not pods["client"].ns.reaches(GATEWAY, node_port), "not on the bridge address"
        assert pods["client"].ns.exchange(GATEWAY6, dual_port)[1] == "backend-b", (
            "no IPv6 CIDR in the flag: IPv6 NodePorts stay on every address"
        )
    finally:
        proxy_node.restart()


def test_external_ips_and_load_balancer_vips(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    create_service(
        kube,
        "lb",
        type="LoadBalancer",
        externalIPs=["203.0.113.10"],
        loadBalancerSourceRanges=["198.18.0.0/24"],
    )
    create_service(
        kube, "lb-denied", type="LoadBalancer", loadBalancerSourceRanges=["192.0.2.0/24"]
    )
    create_service(kube, "lb-proxy", type="LoadBalancer")
    for name in ("lb", "lb-denied", "lb-proxy"):
        kube.create(
            SLICES, slice_object(name, [endpoint(pods["a"].address(), proxy_node.name)], SLICE_HTTP)
        )
    kube.patch(
        f"{SERVICES}/lb/status",
        {"status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.20", "ipMode": "VIP"}]}}},
    )
    kube.patch(
        f"{SERVICES}/lb-denied/status",
        {"status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.21"}]}}},
    )
    proxied_and_vip = [{"ip": "203.0.113.22", "ipMode": "Proxy"}, {"ip": "203.0.113.23"}]
    kube.patch(
        f"{SERVICES}/lb-proxy/status", {"status": {"loadBalancer": {"ingress": proxied_and_vip}}}
    )
    outside = proxy_node.outside
    assert eventually(lambda: outside.exchange("203.0.113.10", 80))[1] == "backend-a"
    assert eventually(lambda: outside.exchange("203.0.113.20", 80))[1] == "backend-a"
    eventually(lambda: "203.0.113.21" in proxy_node.rules())
    # source outside loadBalancerSourceRanges, dropped by the firewall rule (whose objects may
    # reach the kernel a moment after the address's first)
    eventually(
        lambda: (
            not outside.reaches("203.0.113.21", 80)
            and firewall_drops(proxy_node, "203.0.113.21") > 0
        )
    )
    # the status's VIP entry in the kernel shows the daemon has seen its Proxy entry too
    eventually(lambda: "203.0.113.23" in proxy_node.rules())
    assert "203.0.113.22" not in proxy_node.rules(), "ipMode Proxy gets no rule"


def test_load_balancer_without_endpoints_rejects_sources_inside_and_outside_its_ranges(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    for name, source_range, lb_ip in (
        ("lb-empty-open", "198.18.0.0/24", "203.0.113.30"),
        ("lb-empty-closed", "192.0.2.0/24", "203.0.113.31"),
    ):
        create_service(kube, name, type="LoadBalancer", loadBalancerSourceRanges=[source_range])
        kube.patch(
            f"{SERVICES}/{name}/status",
            {"status": {"loadBalancer": {"ingress": [{"ip": lb_ip}]}}},
        )
    # Not DNATed, the packets are forwarded: the pods have made the node a router.
    outside = proxy_node.outside
    assert eventually(lambda: refused(outside, "203.0.113.30", 80))
    assert eventually(lambda: refused(outside, "203.0.113.31", 80)), (
        "no firewall without endpoints, as in kube-proxy's iptables mode"
    )


def test_external_traffic_policy_local(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_backed(
        kube,
        "local",
        type="LoadBalancer",
        externalTrafficPolicy="Local",
        endpoints=[endpoint(pods["a"].address(), proxy_node.name)],
    )
    node_port = svc["spec"]["ports"][0]["nodePort"]
    health_port = svc["spec"]["healthCheckNodePort"]
    outside = proxy_node.outside
    source, backend = eventually(lambda: outside.exchange(UPLINK_NODE, node_port))
    assert (source, backend) == (UPLINK_OUTSIDE, "backend-a"), "source kept, local endpoint"
    status, body = eventually(lambda: proxy_node.http(f"http://127.0.0.1:{health_port}/"))
    assert status == 200 and '"localEndpoints": 1' in body and '"name": "local"' in body

    kube.patch(
        f"{SLICES}/local-ipv4",
        {"endpoints": [endpoint(pods["b"].address(), REMOTE_NODE)]},
    )
    eventually(lambda: proxy_node.http(f"http://127.0.0.1:{health_port}/")[0] == 503)
    assert not outside.reaches(UPLINK_NODE, node_port), "no local endpoint: dropped"
    assert not refused(outside, UPLINK_NODE, node_port), "a drop, not a reject"
    if proxy_node.mode == "ipvs":
        assert not pods["client"].ns.reaches(GATEWAY, node_port), IPVS_ONE_SET
        return
    assert pods["client"].ns.exchange(GATEWAY, node_port)[1] == "backend-b", (
        "pod traffic still reaches cluster-wide endpoints"
    )


def test_both_policies_local_still_send_pods_to_remote_endpoints_of_external_frontends(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_backed(
        kube,
        "both-local",
        type="NodePort",
        externalTrafficPolicy="Local",
        internalTrafficPolicy="Local",
        endpoints=[endpoint(pods["b"].address(), REMOTE_NODE)],
    )
    node_port = svc["spec"]["ports"][0]["nodePort"]
    client = pods["client"].ns
    if proxy_node.mode == "ipvs":
        eventually(lambda: ipvs_frontend(proxy_node, "tcp", GATEWAY, node_port))
        assert not client.reaches(GATEWAY, node_port), IPVS_ONE_SET
    else:
        assert eventually(lambda: client.exchange(GATEWAY, node_port))[1] == "backend-b", (
            "pods reach an external frontend through every endpoint"
        )
    assert not proxy_node.outside.reaches(UPLINK_NODE, node_port), "outside: no local endpoint"
    assert not client.reaches(svc["spec"]["clusterIP"], 80), "cluster IP: no local endpoint"


def test_internal_traffic_policy_local(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_backed(
        kube,
        "itp",
        internalTrafficPolicy="Local",
        endpoints=[
            endpoint(pods["a"].address(), proxy_node.name),
            endpoint(pods["b"].address(), REMOTE_NODE),
        ],
    )
    ip = svc["spec"]["clusterIP"]
    client = pods["client"].ns
    eventually(lambda: client.exchange(ip, 80))
    assert backends_seen(client, ip, 80, 10) == {"backend-a"}
    kube.patch(f"{SLICES}/itp-ipv4", {"endpoints": [endpoint(pods["b"].address(), REMOTE_NODE)]})
    eventually(lambda: not client.reaches(ip, 80))
    assert not refused(client, ip, 80), "no local endpoint: dropped, not rejected"


def test_client_ip_affinity_sticks_and_its_timeout_is_in_the_rules(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_backed(
        kube,
        "sticky",
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 5}},
        endpoints=[
            endpoint(pods["a"].address(), proxy_node.name),
            endpoint(pods["b"].address(), proxy_node.name),
        ],
    )
    ip = svc["spec"]["clusterIP"]
    client = pods["client"].ns
    first = eventually(lambda: client.exchange(ip, 80))[1]
    assert backends_seen(client, ip, 80, 12) == {first}
    assert AFFINITY_SIGN[proxy_node.mode] in proxy_node.rules()


def test_client_ip_affinity_through_a_node_port_lasts_until_its_timeout(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    """From outside through a NodePort a client keeps its endpoint (one client here, so this
    does not tell its own address from the masqueraded one); idle longer than timeoutSeconds,
    it is balanced again.
    IPVS keeps a persistence template while connections it made are in its own table (TIME_WAIT
    for 2 minutes), so the expiry is checked in the other modes only, as upstream does."""
    svc = create_backed(
        kube,
        "sticky-np",
        type="NodePort",
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": AFFINITY_SHORT_TIMEOUT}},
        endpoints=[
            endpoint(pods["a"].address(), proxy_node.name),
            endpoint(pods["b"].address(), proxy_node.name),
        ],
    )
    node_port = svc["spec"]["ports"][0]["nodePort"]
    outside = proxy_node.outside
    first = eventually(lambda: outside.exchange(UPLINK_NODE, node_port))[1]
    assert backends_seen(outside, UPLINK_NODE, node_port, 12) == {first}
    if proxy_node.mode == "ipvs":
        return
    seen = {first}
    for _ in range(20):  # each idle round picks anew: both seen in 20 but with odds 2**-20
        time.sleep(AFFINITY_SHORT_TIMEOUT + 1)
        seen.add(outside.exchange(UPLINK_NODE, node_port)[1])
        if len(seen) == 2:
            break
    assert seen == {"backend-a", "backend-b"}, "the affinity outlived its timeout"


def test_terminating_endpoints_are_a_fallback(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_backed(
        kube,
        "term",
        endpoints=[
            endpoint(
                pods["a"].address(),
                proxy_node.name,
                ready=False,
                serving=True,
                terminating=True,
            ),
            endpoint(
                pods["b"].address(),
                proxy_node.name,
                ready=False,
                serving=False,
                terminating=True,
            ),
        ],
    )
    ip = svc["spec"]["clusterIP"]
    client = pods["client"].ns
    eventually(lambda: client.exchange(ip, 80))
    assert backends_seen(client, ip, 80, 10) == {"backend-a"}, "never a non-serving endpoint"
    kube.patch(
        f"{SLICES}/term-ipv4",
        {
            "endpoints": [
                endpoint(
                    pods["a"].address(),
                    proxy_node.name,
                    ready=False,
                    serving=True,
                    terminating=True,
                ),
                endpoint(pods["b"].address(), proxy_node.name),
            ]
        },
    )
    eventually(lambda: backends_seen(client, ip, 80, 6) == {"backend-b"})


def test_topology_hints_keep_traffic_in_the_zone(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_service(kube, "zoned")
    a = endpoint(pods["a"].address(), proxy_node.name)
    b = endpoint(pods["b"].address(), REMOTE_NODE)
    a["hints"] = {"forZones": [{"name": "zone-a"}]}
    b["hints"] = {"forZones": [{"name": "zone-b"}]}
    kube.create(SLICES, slice_object("zoned", [a, b], SLICE_HTTP))
    ip = svc["spec"]["clusterIP"]
    client = pods["client"].ns
    eventually(lambda: client.exchange(ip, 80))
    assert backends_seen(client, ip, 80, 10) == {"backend-a"}


def test_hairpin_and_off_cluster_sources_are_masqueraded(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_backed(kube, "hairpin", endpoints=[endpoint(pods["a"].address(), proxy_node.name)])
    ip = svc["spec"]["clusterIP"]
    source, backend = eventually(lambda: pods["a"].ns.exchange(ip, 80))
    assert (source, backend) == (GATEWAY, "backend-a"), "a pod reaching itself is masqueraded"
    source, _ = proxy_node.outside.exchange(ip, 80)
    assert source == GATEWAY, "cluster IP traffic from outside the cluster CIDR is masqueraded"
    assert pods["client"].ns.exchange(ip, 80)[0] == pods["client"].address()


def test_masquerade_all(proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube) -> None:
    svc = create_backed(
        kube, "masq-all", endpoints=[endpoint(pods["a"].address(), proxy_node.name)]
    )
    ip = svc["spec"]["clusterIP"]
    try:
        proxy_node.restart("--masquerade-all")
        assert eventually(lambda: pods["client"].ns.exchange(ip, 80))[0] == GATEWAY
    finally:
        proxy_node.restart()
    assert eventually(lambda: pods["client"].ns.exchange(ip, 80))[0] == pods["client"].address()


def test_dual_stack_service_answers_on_both_families(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_service(
        kube, "dual", ipFamilyPolicy="RequireDualStack", ipFamilies=["IPv4", "IPv6"]
    )
    kube.create(
        SLICES, slice_object("dual", [endpoint(pods["a"].address(), proxy_node.name)], SLICE_HTTP)
    )
    kube.create(
        SLICES,
        slice_object(
            "dual",
            [endpoint(pods["b"].address(6), proxy_node.name)],
            SLICE_HTTP,
            address_type="IPv6",
        ),
    )
    ip4, ip6 = svc["spec"]["clusterIPs"]
    client = pods["client"].ns
    assert eventually(lambda: client.exchange(ip4, 80))[1] == "backend-a"
    source6, backend6 = eventually(lambda: client.exchange(ip6, 80))
    assert (source6, backend6) == (pods["client"].address(6), "backend-b")


def test_udp_flow_moves_when_its_endpoint_goes_away(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    svc = create_service(
        kube, "udp", [{"name": "dns", "port": 53, "targetPort": 8080, "protocol": "UDP"}]
    )
    dns = [{"name": "dns", "port": 8080, "protocol": "UDP"}]
    kube.create(SLICES, slice_object("udp", [endpoint(pods["a"].address(), proxy_node.name)], dns))
    ip = svc["spec"]["clusterIP"]
    client = pods["client"].ns
    assert eventually(lambda: client.exchange(ip, 53, "udp", 40000))[1] == "backend-a"
    kube.patch(
        f"{SLICES}/udp-ipv4", {"endpoints": [endpoint(pods["b"].address(), proxy_node.name)]}
    )
    # backend-a still answers, so only the conntrack cleanup can move this flow
    assert eventually(lambda: client.exchange(ip, 53, "udp", 40000)[1] == "backend-b")


def test_ignored_headless_and_external_name_services_get_no_rules(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    other = create_service(
        kube, "other-proxy", labels={"service.kubernetes.io/service-proxy-name": "x"}
    )
    create_service(kube, "headless", clusterIP="None")
    create_service(kube, "extname", type="ExternalName", externalName="example.com", ports=None)
    for name in ("other-proxy", "headless"):
        kube.create(
            SLICES, slice_object(name, [endpoint(pods["a"].address(), proxy_node.name)], SLICE_HTTP)
        )
    marker = create_service(kube, "marker")
    eventually(lambda: marker["spec"]["clusterIP"] in proxy_node.rules())
    rules = proxy_node.rules()
    assert other["spec"]["clusterIP"] not in rules
    assert "default/headless" not in rules and "default/extname" not in rules


def test_metrics_health_and_proxy_mode(proxy_node: ProxyNode) -> None:
    assert proxy_node.http("http://127.0.0.1:10249/proxyMode") == (200, proxy_node.mode)
    by_mode = {
        "iptables": (
            'kubeproxy_sync_proxy_rules_iptables_total{ip_family="IPv4",table="nat"}',
            'kubeproxy_sync_proxy_rules_iptables_restore_failures_total{ip_family="IPv6"}',
        ),
        "nftables": ('kubeproxy_sync_proxy_rules_nftables_sync_failures_total{ip_family="IPv4"}',),
    }
    metrics = proxy_node.http("http://127.0.0.1:10249/metrics")[1]
    for name in (
        'kubeproxy_sync_proxy_rules_duration_seconds_bucket{ip_family="IPv4",le="0.001"}',
        'kubeproxy_sync_full_proxy_rules_duration_seconds_count{ip_family="IPv6"}',
        'kubeproxy_sync_partial_proxy_rules_duration_seconds_count{ip_family="IPv4"}',
        'kubeproxy_network_programming_duration_seconds_count{ip_family="IPv4"}',
        'kubeproxy_sync_proxy_rules_last_timestamp_seconds{ip_family="IPv6"}',
        'kubeproxy_sync_proxy_rules_last_queued_timestamp_seconds{ip_family="IPv4"}',
        'kubeproxy_sync_proxy_rules_endpoint_changes_pending{ip_family="IPv4"}',
        'kubeproxy_sync_proxy_rules_no_local_endpoints_total{ip_family="IPv6",traffic_policy="external"}',
        'kubeproxy_conntrack_reconciler_deleted_entries_total{ip_family="IPv4"}',
        "kubeproxy_sync_proxy_rules_endpoint_changes_total ",
        "kubeproxy_sync_proxy_rules_service_changes_pending ",
        *by_mode.get(proxy_node.mode, ()),
    ):
        assert name in metrics, name
    status, body = proxy_node.http("http://127.0.0.1:10256/healthz")
    health = json.loads(body)
    assert status == 200 and health["healthy"] and health["nodeEligible"]
    assert {"lastUpdated", "currentTime"} <= health.keys()
    assert {family: entry["healthy"] for family, entry in health["status"].items()} == {
        "IPv4": True,
        "IPv6": True,
    }
    assert proxy_node.http("http://127.0.0.1:10256/livez")[0] == 200


def test_sync_after_a_change_is_partial(proxy_node: ProxyNode, kube: Kube) -> None:
    partial, full = (
        f"kubeproxy_sync_{kind}_proxy_rules_duration_seconds_count" for kind in ("partial", "full")
    )
    ipv4 = 'ip_family="IPv4"'
    partial_before, full_before = proxy_node.metric(partial, ipv4), proxy_node.metric(full, ipv4)
    ip = create_service(kube, "partial")["spec"]["clusterIP"]
    eventually(lambda: ip in proxy_node.rules())
    eventually(lambda: proxy_node.metric(partial, ipv4) > partial_before)
    assert proxy_node.metric(full, ipv4) == full_before, (
        "the change was programmed by a partial sync"
    )


EARLY_CLUSTER_IP = "10.96.200.200"
EARLY_SOURCE_PORT = 45123
"""The source port a test's attempt that gets no answer is made from, then reused."""


def attempted(proxy_node: ProxyNode, ip: str, source_port: int) -> bool:
    """Whether the node's conntrack table holds an entry of a TCP connection from this source
    port to `ip` (the reconciler deletes a never-answered one after the sync, on its thread)."""
    listed = proxy_node.ns.run(
        "conntrack", "-L", "-p", "tcp", "--orig-dst", ip, "--sport", str(source_port), check=False
    )
    return bool(listed.stdout.strip())


def test_a_connection_tried_before_a_cluster_ips_rules_leaves_its_source_port_usable(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    """A SYN sent to a ClusterIP before the proxy wrote its rules is not DNATed: routed on (the
    iptables and IPVS modes, as kube-proxy's) or dropped (the nftables mode), unanswered. Once
    the rules are written, the same client reusing that source port for that address is
    served: the entry the first SYN left (SYN_SENT, 120 s) is gone."""
    client = pods["client"].ns
    early = connect_outcome(client, EARLY_CLUSTER_IP, 80, EARLY_SOURCE_PORT, timeout=1)
    assert early != "open"
    backed = [endpoint(pods["a"].address(), proxy_node.name)]
    create_backed(kube, "early", endpoints=backed, clusterIP=EARLY_CLUSTER_IP)
    eventually(lambda: client.exchange(EARLY_CLUSTER_IP, 80))
    eventually(lambda: not attempted(proxy_node, EARLY_CLUSTER_IP, EARLY_SOURCE_PORT))
    assert connect_outcome(client, EARLY_CLUSTER_IP, 80, EARLY_SOURCE_PORT) == "open"


GONE_ENDPOINT = "10.244.2.250"
"""On another node's range, which the outside host has no route to: nothing answers it."""


def test_an_attempt_to_an_endpoint_since_gone_leaves_its_source_port_usable(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    """A SYN DNATed to an endpoint that no longer answers (its node rebooting, say, the
    EndpointSlice not yet changed) gets no answer, and its entry stays (SYN_SENT, 120 s). Once
    the slice names a serving endpoint instead, the same client reusing that source port for
    that ClusterIP reaches it: the entry went with the change."""
    client = pods["client"].ns
    svc = create_backed(kube, "moving", endpoints=[endpoint(pods["a"].address(), proxy_node.name)])
    ip = svc["spec"]["clusterIP"]
    eventually(lambda: client.exchange(ip, 80))
    kube.patch(f"{SLICES}/moving-ipv4", {"endpoints": [endpoint(GONE_ENDPOINT, REMOTE_NODE)]})
    eventually(lambda: connect_outcome(client, ip, 80, timeout=1) != "open")
    assert connect_outcome(client, ip, 80, EARLY_SOURCE_PORT, timeout=1) != "open"
    assert attempted(proxy_node, ip, EARLY_SOURCE_PORT)
    kube.patch(
        f"{SLICES}/moving-ipv4", {"endpoints": [endpoint(pods["b"].address(), proxy_node.name)]}
    )
    eventually(lambda: client.exchange(ip, 80))
    eventually(lambda: not attempted(proxy_node, ip, EARLY_SOURCE_PORT))
    assert connect_outcome(client, ip, 80, EARLY_SOURCE_PORT) == "open"


def test_full_syncs_keep_every_connection_flowing(
    proxy_node: ProxyNode, pods: dict[str, Any], kube: Kube
) -> None:
    """A full sync rewrites every service's rules (the nftables mode into its other generation
    of maps, swapped in by its last transaction). Six are forced by the node's zone changing
    while a client connects without pause to a plain and a sticky ClusterIP: not one connection
    fails and the sticky one keeps its endpoint."""
    backed = [
        endpoint(pods["a"].address(), proxy_node.name),
        endpoint(pods["b"].address(), proxy_node.name),
    ]
    plain = create_backed(kube, "steady", endpoints=backed)["spec"]["clusterIP"]
    sticky = create_backed(kube, "steady-sticky", sessionAffinity="ClientIP", endpoints=backed)
    sticky_ip = sticky["spec"]["clusterIP"]
    client = pods["client"].ns
    for ip in (plain, sticky_ip):
        eventually(lambda ip=ip: client.exchange(ip, 80))
    full = "kubeproxy_sync_full_proxy_rules_duration_seconds_count"
    ipv4 = 'ip_family="IPv4"'
    node = f"{NODES}/{proxy_node.name}"
    script = [sys.executable, str(ECHO), "repeat", plain, "80", sticky_ip]
    connecting = subprocess.Popen(
        ["ip", "netns", "exec", client.name, *script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for zone in ("zone-b", "zone-a") * 3:
            before = proxy_node.metric(full, ipv4)
            kube.patch(node, {"metadata": {"labels": {ZONE_LABEL: zone}}})
            eventually(lambda before=before: proxy_node.metric(full, ipv4) > before)
    finally:
        printed = connecting.communicate(timeout=30)[0]
        kube.patch(node, {"metadata": {"labels": {ZONE_LABEL: "zone-a"}}})
    report = json.loads(printed)
    assert report["failures"] == []
    answers = report["answers"]
    assert min(len(answers[plain]), len(answers[sticky_ip])) >= 6
    assert set(answers[plain]) == {"backend-a", "backend-b"}
    assert set(answers[sticky_ip]) in ({"backend-a"}, {"backend-b"}), "the sticky one stayed"
