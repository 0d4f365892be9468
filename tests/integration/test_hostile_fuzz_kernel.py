"""API objects generated within what the API server accepts (names, labels, port names, ports,
protocols, addresses of both families, ipBlocks with excepts, every Service type), through the
model, the compiler and the renderers, into a scratch namespace's kernel: every sync must be
taken whole, with no service port left out and no pod quarantined. The examples per test are
few (each loads rules into the kernel); `make fuzz` runs more (KNIT_FUZZ_EXAMPLES)."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.lab.netns import Netns
from proxyd.iptables.proxier import IptablesProxier
from proxyd.metrics import Metrics
from proxyd.nftables.proxier import NftablesProxier
from proxyd.policy.enforcer import PolicyEnforcer
from proxyd.proxier import Proxier, ProxyOptions
from proxyd.tracker import Changes
from tests.support import hostile_objects

EXAMPLES = max(1, int(os.environ.get("KNIT_FUZZ_EXAMPLES", "300")) // 12)
"""25 per test in make test, 1,666 in make fuzz (about 17 minutes for the three)."""
NODE = hostile_objects.NODE
OPTIONS = ProxyOptions(cluster_cidrs=("10.244.0.0/16", "fd10::/48"))
PROTOCOLS = ("TCP", "UDP", "SCTP")
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

label = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)
dns_1035 = st.from_regex(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)
subdomain = st.lists(label, min_size=1, max_size=4).map(".".join).filter(lambda s: len(s) <= 253)
port_name = st.from_regex(r"[a-z]([a-z0-9]{0,13}[a-z0-9])?", fullmatch=True)
label_name = st.from_regex(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?", fullmatch=True)
label_key = st.one_of(label_name, st.tuples(subdomain, label_name).map("/".join))
label_value = st.one_of(st.just(""), label_name)
labels = st.dictionaries(label_key, label_value, max_size=3)
protocol = st.sampled_from(PROTOCOLS)
port = st.integers(1, 65535)
ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(str)


def cidr(version: int) -> st.SearchStrategy[str]:
    bits = 32 if version == 4 else 128
    return st.tuples(st.ip_addresses(v=version), st.integers(0, bits)).map(
        lambda pair: str(ipaddress.ip_network(f"{pair[0]}/{pair[1]}", strict=False))
    )


@st.composite
def ip_block(draw: st.DrawFn) -> dict[str, Any]:
    version = draw(st.sampled_from((4, 6)))
    network = ipaddress.ip_network(draw(cidr(version)))
    holes = []
    for _ in range(draw(st.integers(0, 4))):
        if network.prefixlen == network.max_prefixlen:
            break
        prefix = draw(st.integers(network.prefixlen + 1, network.max_prefixlen))
        subnets = 2 ** (prefix - network.prefixlen)
        index = draw(st.integers(0, subnets - 1))
        size = 2 ** (network.max_prefixlen - prefix)
        first = int(network.network_address) + index * size
        holes.append(str(ipaddress.ip_network((first, prefix))))
    return {"cidr": str(network), "except": holes}


@st.composite
def service(draw: st.DrawFn, index: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A Service of any type with its slices, in the namespace `ns`."""
    kind = draw(st.sampled_from(("ClusterIP", "NodePort", "LoadBalancer")))
    names = draw(st.lists(port_name, min_size=1, max_size=3, unique=True))
    ports = [
        {
            "name": name,
            "protocol": draw(protocol),
            "port": draw(port),
            **({"nodePort": 30000 + 10 * index + n} if kind != "ClusterIP" else {}),
        }
        for n, name in enumerate(names)
    ]
    name = draw(dns_1035)
    spec: dict[str, Any] = {
        "type": kind,
        "clusterIPs": [f"10.96.{index}.{draw(st.integers(1, 254))}", f"fd00::{index}:1"],
        "ports": ports,
        "externalIPs": draw(st.lists(st.one_of(ipv4, ipv6), max_size=2, unique=True)),
        "internalTrafficPolicy": draw(st.sampled_from(("Cluster", "Local"))),
    }
    if draw(st.booleans()):
        spec["sessionAffinity"] = "ClientIP"
        timeout = draw(st.integers(1, 86400))
        spec["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": timeout}}
    status: dict[str, Any] = {}
    if kind == "LoadBalancer":
        spec["externalTrafficPolicy"] = draw(st.sampled_from(("Cluster", "Local")))
        spec["healthCheckNodePort"] = 32000 + index
        spec["loadBalancerSourceRanges"] = draw(
            st.lists(st.one_of(cidr(4), cidr(6)), max_size=2, unique=True)
        )
        ingress = draw(st.lists(st.one_of(ipv4, ipv6), max_size=2, unique=True))
        status = {"loadBalancer": {"ingress": [{"ip": ip} for ip in ingress]}}
    obj = {"metadata": {"namespace": "ns", "name": name}, "spec": spec, "status": status}
    slices = []
    for family, addresses in (("IPv4", ipv4), ("IPv6", ipv6)):
        endpoints = draw(st.lists(addresses, min_size=0, max_size=3, unique=True))
        slices.append(
            {
                "metadata": {
                    "namespace": "ns",
                    "name": f"{name}-{family.lower()}",
                    "labels": {"kubernetes.io/service-name": name},
                },
                "addressType": family,
                "ports": [
                    {"name": p["name"], "protocol": p["protocol"], "port": draw(port)}
                    for p in ports
                ],
                "endpoints": [
                    {
                        "addresses": [address],
                        "conditions": {"ready": draw(st.booleans()), "serving": True},
                        "nodeName": draw(st.sampled_from((NODE, "node-b"))),
                    }
                    for address in endpoints
                ],
            }
        )
    return obj, slices


@st.composite
def services(draw: st.DrawFn) -> Changes:
    return hostile_objects.changes(draw(service(index)) for index in range(draw(st.integers(1, 4))))


@pytest.mark.parametrize("proxier", [IptablesProxier, NftablesProxier])
def test_generated_services_sync_whole(
    proxier: Callable[[ProxyOptions, tuple[int, ...], Metrics], Proxier],
    make_netns: Callable[[str], Netns],
) -> None:
    ns = make_netns("knit-fuzz")

    @SETTINGS
    @given(changes=services())
    def sync(changes: Changes) -> None:
        metrics = Metrics()
        with ns.entered():
            proxier(OPTIONS, (4, 6), metrics).sync(changes)
        for family in ("IPv4", "IPv6"):
            left_out = metrics.registry.get_sample_value(
                "knit_sync_proxy_rules_refused_service_ports", {"ip_family": family}
            )
            assert not left_out

    sync()


@st.composite
def policy_world(draw: st.DrawFn) -> dict[str, list[dict[str, Any]]]:
    namespace = draw(label)
    namespace_labels = draw(labels)
    pods = []
    for index in range(draw(st.integers(1, 4))):
        pods.append(
            {
                "metadata": {
                    "namespace": namespace,
                    "name": draw(subdomain),
                    "uid": f"uid-{index}",
                    "labels": draw(labels),
                },
                "spec": {
                    "nodeName": NODE,
                    "containers": [
                        {
                            "name": "c",
                            "ports": [
                                {
                                    "name": draw(port_name),
                                    "containerPort": draw(port),
                                    "protocol": draw(protocol),
                                }
                            ],
                        }
                    ],
                },
                "status": {
                    "phase": "Running",
                    "podIPs": [{"ip": f"10.244.0.{index + 2}"}, {"ip": f"fd10::{index + 2}"}],
                },
            }
        )

    def selector() -> dict[str, Any]:
        return {"matchLabels": draw(labels)}

    def peer() -> dict[str, Any]:
        kind = draw(st.sampled_from(("pods", "namespaces", "both", "block")))
        if kind == "block":
            return {"ipBlock": draw(ip_block())}
        found: dict[str, Any] = {}
        if kind in ("pods", "both"):
            found["podSelector"] = selector()
        if kind in ("namespaces", "both"):
            found["namespaceSelector"] = selector()
        return found

    def rule(peers_key: str) -> dict[str, Any]:
        ports = []
        for _ in range(draw(st.integers(0, 2))):
            entry: dict[str, Any] = {"protocol": draw(protocol)}
            if draw(st.booleans()):
                entry["port"] = draw(port_name)
            else:
                first = draw(port)
                entry["port"] = first
                if draw(st.booleans()):
                    entry["endPort"] = draw(st.integers(first, 65535))
            ports.append(entry)
        return {peers_key: [peer() for _ in range(draw(st.integers(0, 3)))], "ports": ports}

    policies = [
        {
            "metadata": {"namespace": namespace, "name": draw(subdomain)},
            "spec": {
                "podSelector": selector() if draw(st.booleans()) else {},
                "policyTypes": draw(
                    st.sampled_from((["Ingress"], ["Egress"], ["Ingress", "Egress"]))
                ),
                "ingress": [rule("from") for _ in range(draw(st.integers(0, 2)))],
                "egress": [rule("to") for _ in range(draw(st.integers(0, 2)))],
            },
        }
        for _ in range(draw(st.integers(1, 3)))
    ]
    namespaces = [{"metadata": {"name": namespace, "labels": namespace_labels}}]
    return {"pods": pods, "policies": policies, "namespaces": namespaces}


def test_generated_policies_load_whole(make_netns: Callable[[str], Netns]) -> None:
    ns = make_netns("knit-fuzz")

    @SETTINGS
    @given(world=policy_world())
    def sync(world: dict[str, list[dict[str, Any]]]) -> None:
        enforcer = PolicyEnforcer(NODE, (4, 6), 3600.0, Metrics())
        state = enforcer.state
        state.replace_namespaces(world["namespaces"])
        state.replace_pods(world["pods"])
        state.replace_policies(world["policies"])
        state.replace_cluster_policies([])
        try:
            with ns.entered():
                enforcer.sync()
        finally:
            enforcer.stop()
        assert enforcer.failures == {4: 0, 6: 0}
        assert enforcer.health(60, 0).keys() == {4, 6}
        assert all(not health.quarantined for health in enforcer.health(60, 0).values())

    sync()
