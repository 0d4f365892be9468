"""knit-proxyd against the real kube-proxy, by their verdicts on the same packets.

Two identical worlds share one API server: two node namespaces that are the same Node (one
name, one address), so both proxies read the same Services, EndpointSlices and Node; each has
its own outside host and the same pods (the IPAM of an empty node hands out the same
addresses in the same order). One world runs knit-proxyd, the other the kube-proxy built from
the pinned kubernetes module, in the same mode; the module runs once per mode. Each test makes
its objects once and asks both worlds the same questions; a verdict is what a client saw:
which backends answered and the source address they saw, refused at once, or no answer.

The verdicts must be equal, except where docs/proxy.md ("Beside kube-proxy") lists a
difference with its reason (DIFFERENCES): there the test asserts both sides as they stand, so
a change to either shows.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest
from kubernetes.client import ApiClient

from deploy.lab.controlplane import ControlPlane
from deploy.lab.kube import NODES, SERVICES, SLICES, Kube, endpoint, node_object, slice_object
from deploy.lab.netns import ECHO, Netns, unique_name
from deploy.lab.process import eventually
from tests.support.cni_env import UPLINK_NODE
from tests.support.proxy_env import (
    LAST_SYNC,
    REMOTE_NODE,
    SLICE_HTTP,
    ProxyNode,
    create_service,
    running_proxy_node,
)

KNIT, KUBE_PROXY = "knit-proxyd", "kube-proxy"
PORTS = ((8080, "tcp"), (8080, "udp"))
UNALLOCATED_CLUSTER_IP = "10.96.255.254"
"""Inside the API server's service CIDR (10.96.0.0/16), held by no Service; the outside host
of each world owns it."""
LOCALHOST_NODE_PORT = "a NodePort on 127.0.0.1, from the node"
UNDECLARED_PORT = "a port the Service does not declare, on its cluster IP"
BRIDGE_NODE_PORT = "a pod to a NodePort on the node's bridge address"
GATEWAY = "10.244.1.1"
"""The node's address on the pods' bridge."""
DIFFERENCES: dict[tuple[str, str], dict[str, str]] = {
    ("nftables", LOCALHOST_NODE_PORT): {KNIT: "answered by backend-a", KUBE_PROXY: "refused"},
    ("nftables", BRIDGE_NODE_PORT): {
        KNIT: f"answered by backend-a, source {GATEWAY}",
        KUBE_PROXY: "refused",
    },
}
"""(mode, question) -> each side's verdict, where they differ (docs/proxy.md says why)."""


@pytest.fixture(scope="module", params=["iptables", "nftables"])
def proxy_mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


class World:
    """One of the two: a node running one proxy, its outside host and its pods."""

    def __init__(self, proxy: ProxyNode) -> None:
        self.proxy = proxy
        self.pods = {
            "a": proxy.add_pod("backend-a", *PORTS),
            "b": proxy.add_pod("backend-b", *PORTS),
            "client": proxy.add_pod("client"),
        }
        # A host outside owns an address of the service CIDR and can answer the client pod:
        # routed on, a connection to that address is answered; dropped, it is not.
        outside = proxy.outside
        outside.run("ip", "address", "add", f"{UNALLOCATED_CLUSTER_IP}/32", "dev", "lo")
        outside.run("ip", "route", "add", self.pods["client"].address(), "via", UPLINK_NODE)
        outside.serve(UNALLOCATED_CLUSTER_IP, 80, "tcp", "outside")

    def settled(self, moment: float) -> bool:
        """An IPv4 sync ended after moment (the tests' objects are IPv4; each proxy syncs
        only the families a change touches)."""
        return self.proxy.metric(LAST_SYNC, 'ip_family="IPv4"') > moment


@pytest.fixture(scope="module")
def worlds(
    proxy_mode: str,
    control_plane: ControlPlane,
    kube_api: ApiClient,
    module_netns: Callable[[str], Netns],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, World]]:
    kube = Kube(kube_api)
    name = unique_name("twin")
    kube.create(NODES, node_object(name, [UPLINK_NODE], zone="zone-a"))
    try:
        with ExitStack() as stack:
            proxies = {
                program: stack.enter_context(
                    running_proxy_node(
                        control_plane,
                        kube,
                        module_netns("node"),
                        module_netns,
                        tmp_path_factory.mktemp(program),
                        proxy_mode,
                        name=name,
                        kube_proxy=program == KUBE_PROXY,
                    )
                )
                for program in (KNIT, KUBE_PROXY)
            }
            made = {program: World(proxy) for program, proxy in proxies.items()}
            addresses = {
                program: [pod.address() for pod in world.pods.values()]
                for program, world in made.items()
            }
            assert addresses[KNIT] == addresses[KUBE_PROXY], "the twins' pods differ"
            yield made
    finally:
        kube.cleanup()


def outcome(ns: Netns, host: str, port: int, proto: str = "tcp") -> str:
    """What one request saw: "answered by BACKEND, source ADDRESS", "refused" or "no answer"
    (dropped, or an ICMP error other than port unreachable: named)."""
    argv = [sys.executable, str(ECHO), "request", host, str(port), proto]
    result = ns.run(*argv, check=False, timeout=15)
    if result.returncode == 0:
        source, backend = result.stdout.split()
        return f"answered by {backend}, source {source}"
    error = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
    if "ConnectionRefused" in error:
        return "refused"
    if "timed out" in error or "TimeoutError" in error:
        return "no answer"
    return error


def backends(ns: Netns, host: str, port: int, proto: str = "tcp", tries: int = 12) -> str:
    """The backends that answered `tries` requests, or the first other outcome."""
    seen = set()
    for _ in range(tries):
        seen_once = outcome(ns, host, port, proto)
        if not seen_once.startswith("answered by "):
            return seen_once
        seen.add(seen_once.split()[2].rstrip(","))
    return "answered by " + ", ".join(sorted(seen))


def source_seen(ns: Netns, host: str, port: int) -> str:
    """The source address the backend saw (whichever answered), or the other outcome."""
    seen = outcome(ns, host, port)
    return seen.split(", source ", 1)[1] if ", source " in seen else seen


Question = Callable[[World], str]


def compare(
    worlds: dict[str, World], mode: str, since: float, questions: dict[str, Question]
) -> None:
    """Ask both worlds every question once both have synced what the test made after
    `since`; each answer must be the other's, or the difference DIFFERENCES lists."""
    for world in worlds.values():
        eventually(lambda world=world: world.settled(since), 30, "a sync after the objects")
    time.sleep(1.0)  # a change that reached a watch during that sync: the next sync
    unexpected = {}
    for question, ask in questions.items():
        answers = {program: ask(world) for program, world in worlds.items()}
        print(f"{mode}: {question}: {answers}")
        listed = DIFFERENCES.get((mode, question))
        if answers != listed and (listed is not None or answers[KNIT] != answers[KUBE_PROXY]):
            unexpected[question] = answers
    assert not unexpected, (
        f"answers unlike kube-proxy's, or a listed difference changed: {unexpected}"
    )


@pytest.fixture
def began() -> float:
    """When the test began, before it made anything."""
    return time.time()


def backed(
    kube: Kube, worlds: dict[str, World], name: str, *local: str, remote: str = "", **spec: Any
) -> dict[str, Any]:
    """A Service with an IPv4 slice of the pods named in `local` (on the twins' node) and
    `remote` (said to be on another node; the pod is reachable here all the same)."""
    world = worlds[KNIT]
    node = world.proxy.name
    endpoints = [endpoint(world.pods[pod].address(), node) for pod in local]
    if remote:
        endpoints.append(endpoint(world.pods[remote].address(), REMOTE_NODE))
    service = create_service(kube, name, **spec)
    kube.create(SLICES, slice_object(name, endpoints, SLICE_HTTP))
    return service


def test_cluster_ip_from_pods_and_from_the_node(
    worlds: dict[str, World], proxy_mode: str, kube: Kube, began: float
) -> None:
    svc = backed(kube, worlds, "spread", "a", remote="b")
    ip = svc["spec"]["clusterIP"]
    compare(
        worlds,
        proxy_mode,
        began,
        {
            "a pod to a cluster IP": lambda w: backends(w.pods["client"].ns, ip, 80),
            "a pod to a cluster IP, the source seen": lambda w: source_seen(
                w.pods["client"].ns, ip, 80
            ),
            "the node to a cluster IP": lambda w: backends(w.proxy.ns, ip, 80),
            "outside to a cluster IP": lambda w: backends(w.proxy.outside, ip, 80),
            UNDECLARED_PORT: lambda w: outcome(w.pods["client"].ns, ip, 81),
            "a pod to an address of the service CIDR no Service holds": lambda w: outcome(
                w.pods["client"].ns, UNALLOCATED_CLUSTER_IP, 80
            ),
            "the node to an address of the service CIDR no Service holds": lambda w: outcome(
                w.proxy.ns, UNALLOCATED_CLUSTER_IP, 80
            ),
        },
    )


def test_hairpin(worlds: dict[str, World], proxy_mode: str, kube: Kube, began: float) -> None:
    ip = backed(kube, worlds, "hairpin", "a")["spec"]["clusterIP"]
    compare(
        worlds,
        proxy_mode,
        began,
        {"a pod to itself through its Service": lambda w: outcome(w.pods["a"].ns, ip, 80)},
    )


def test_no_endpoints(worlds: dict[str, World], proxy_mode: str, kube: Kube, began: float) -> None:
    svc = create_service(kube, "empty", type="NodePort")
    ip, node_port = svc["spec"]["clusterIP"], svc["spec"]["ports"][0]["nodePort"]
    compare(
        worlds,
        proxy_mode,
        began,
        {
            "a pod to a cluster IP without endpoints": lambda w: outcome(
                w.pods["client"].ns, ip, 80
            ),
            "outside to a NodePort without endpoints": lambda w: outcome(
                w.proxy.outside, UPLINK_NODE, node_port
            ),
        },
    )


def test_node_ports(worlds: dict[str, World], proxy_mode: str, kube: Kube, began: float) -> None:
    svc = backed(kube, worlds, "np", "a", type="NodePort")
    node_port = svc["spec"]["ports"][0]["nodePort"]
    compare(
        worlds,
        proxy_mode,
        began,
        {
            "outside to a NodePort": lambda w: outcome(w.proxy.outside, UPLINK_NODE, node_port),
            BRIDGE_NODE_PORT: lambda w: outcome(w.pods["client"].ns, GATEWAY, node_port),
            LOCALHOST_NODE_PORT: lambda w: backends(w.proxy.ns, "127.0.0.1", node_port, tries=1),
        },
    )


def test_udp_cluster_ip(
    worlds: dict[str, World], proxy_mode: str, kube: Kube, began: float
) -> None:
    ports = [{"name": "http", "port": 53, "targetPort": 8080, "protocol": "UDP"}]
    svc = create_service(kube, "dns", ports)
    pods = worlds[KNIT].pods
    kube.create(
        SLICES,
        slice_object(
            "dns",
            [endpoint(pods["a"].address(), worlds[KNIT].proxy.name)],
            [{"name": "http", "port": 8080, "protocol": "UDP"}],
        ),
    )
    ip = svc["spec"]["clusterIP"]
    compare(
        worlds,
        proxy_mode,
        began,
        {"a pod to a UDP cluster IP": lambda w: outcome(w.pods["client"].ns, ip, 53, "udp")},
    )


def test_external_traffic_policy_local(
    worlds: dict[str, World], proxy_mode: str, kube: Kube, began: float
) -> None:
    svc = backed(kube, worlds, "etp", "a", type="LoadBalancer", externalTrafficPolicy="Local")
    node_port = svc["spec"]["ports"][0]["nodePort"]
    health = svc["spec"]["healthCheckNodePort"]

    def health_status(world: World) -> str:
        return str(world.proxy.http(f"http://{UPLINK_NODE}:{health}/")[0])

    compare(
        worlds,
        proxy_mode,
        began,
        {
            "outside to a Local NodePort with a local endpoint": lambda w: outcome(
                w.proxy.outside, UPLINK_NODE, node_port
            ),
            "its health check node port": health_status,
        },
    )
    pods = worlds[KNIT].pods
    patched = time.time()
    kube.patch(f"{SLICES}/etp-ipv4", {"endpoints": [endpoint(pods["b"].address(), REMOTE_NODE)]})
    compare(
        worlds,
        proxy_mode,
        patched,
        {
            "outside to a Local NodePort without a local endpoint": lambda w: outcome(
                w.proxy.outside, UPLINK_NODE, node_port
            ),
            "a pod to a Local NodePort without a local endpoint": lambda w: outcome(
                w.pods["client"].ns, UPLINK_NODE, node_port
            ),
            "its health check node port, no local endpoint": health_status,
        },
    )


def test_internal_traffic_policy_local(
    worlds: dict[str, World], proxy_mode: str, kube: Kube, began: float
) -> None:
    svc = backed(kube, worlds, "itp", remote="b", internalTrafficPolicy="Local")
    ip = svc["spec"]["clusterIP"]
    compare(
        worlds,
        proxy_mode,
        began,
        {
            "a pod to a Local cluster IP without a local endpoint": lambda w: outcome(
                w.pods["client"].ns, ip, 80
            )
        },
    )


def test_client_ip_affinity(
    worlds: dict[str, World], proxy_mode: str, kube: Kube, began: float
) -> None:
    svc = backed(
        kube,
        worlds,
        "sticky",
        "a",
        "b",
        sessionAffinity="ClientIP",
        sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}},
    )
    ip = svc["spec"]["clusterIP"]
    compare(
        worlds,
        proxy_mode,
        began,
        {
            "a pod to a ClientIP-affine cluster IP, how many backends": lambda w: (
                backends(w.pods["client"].ns, ip, 80)
                .replace("backend-a", "one")
                .replace("backend-b", "one")
            )
        },
    )


def test_load_balancer_source_ranges_and_external_ips(
    worlds: dict[str, World], proxy_mode: str, kube: Kube, began: float
) -> None:
    for name, source_range, lb_ip, external_ip in (
        ("lb-open", "198.18.0.0/24", "203.0.113.40", "203.0.113.50"),
        ("lb-closed", "192.0.2.0/24", "203.0.113.41", "203.0.113.51"),
    ):
        backed(
            kube,
            worlds,
            name,
            "a",
            type="LoadBalancer",
            loadBalancerSourceRanges=[source_range],
            externalIPs=[external_ip],
        )
        kube.patch(
            f"{SERVICES}/{name}/status", {"status": {"loadBalancer": {"ingress": [{"ip": lb_ip}]}}}
        )
    compare(
        worlds,
        proxy_mode,
        began,
        {
            "outside to a load balancer IP, inside its source ranges": lambda w: outcome(
                w.proxy.outside, "203.0.113.40", 80
            ),
            "outside to a load balancer IP, outside its source ranges": lambda w: outcome(
                w.proxy.outside, "203.0.113.41", 80
            ),
            "outside to an external IP": lambda w: outcome(w.proxy.outside, "203.0.113.50", 80),
            "a pod to a load balancer IP outside its source ranges": lambda w: outcome(
                w.pods["client"].ns, "203.0.113.41", 80
            ),
        },
    )
