"""API objects at the limits the API server accepts, as a tenant could create them: every name,
label and port name at its maximum length, both families, every Service type. Shared by the
rendering tests (tests/unit) and the kernel's verdict on the rendered text (tests/integration)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from proxyd.model import NodeInfo, endpoints_for, parse_endpoint_slice, parse_service
from proxyd.tracker import Changes, ServiceView

NAMESPACE = "n" * 63
"""A namespace name: a DNS-1123 label."""
SERVICE = "s" * 63
"""A Service name: a DNS-1035 label."""
PORT_NAME = "p" * 15
"""A port name: an IANA service name."""
POD = "p" * 253
"""A pod name: a DNS-1123 subdomain."""
POLICY = "q" * 253
LABEL_KEY = f"{'k' * 253}/{'l' * 63}"
LABEL_VALUE = "v" * 63
NODE = "node-a"
ENDPOINTS_4 = ("10.244.1.5", "10.244.2.5")
ENDPOINTS_6 = ("fd10:ffff:ffff:ffff:ffff:ffff:ffff:5", "fd10:ffff:ffff:ffff:ffff:ffff:ffff:6")
"""IPv6 endpoints that write out long."""
PROTOCOLS = ("TCP", "UDP", "SCTP")
"""Every protocol a Service port takes (the development kernel has no SCTP sockets, but nft and
iptables take SCTP rules)."""

Obj = dict[str, Any]


def services() -> list[Obj]:
    """One Service of each type, each dual-stack, with session affinity, every traffic policy
    and every kind of frontend, and ports named at the maximum length."""
    base: Obj = {
        "ipFamilies": ["IPv4", "IPv6"],
        "sessionAffinity": "ClientIP",
        "sessionAffinityConfig": {"clientIP": {"timeoutSeconds": 86400}},
        "externalIPs": ["203.0.113.7", "2001:db8:ffff:ffff:ffff:ffff:ffff:7"],
        "internalTrafficPolicy": "Local",
    }
    made = []
    for index, kind in enumerate(("ClusterIP", "NodePort", "LoadBalancer")):
        spec: Obj = {
            **base,
            "type": kind,
            "clusterIPs": [f"10.96.0.{10 + index}", f"fd00::{10 + index}"],
            "ports": [
                {
                    "name": f"{PORT_NAME[:-2]}{protocol[0].lower()}{n}",
                    "protocol": protocol,
                    "port": 65535 - n,
                    **({"nodePort": 30000 + 10 * index + n} if kind != "ClusterIP" else {}),
                }
                for n, protocol in enumerate(PROTOCOLS)
            ],
        }
        status: Obj = {}
        if kind == "LoadBalancer":
            spec["externalTrafficPolicy"] = "Local"
            spec["healthCheckNodePort"] = 32000
            spec["loadBalancerSourceRanges"] = ["192.0.2.0/24", "2001:db8:1::/48"]
            status = {"loadBalancer": {"ingress": [{"ip": "198.51.100.9"}, {"ip": "2001:db8::9"}]}}
        made.append(
            {
                "metadata": {"namespace": NAMESPACE, "name": f"{SERVICE[:-1]}{index}"},
                "spec": spec,
                "status": status,
            }
        )
    return made


def endpoint_slices(service: Obj) -> list[Obj]:
    """The Service's slices, one per family, with long slice names and a local endpoint."""
    ports = [
        {"name": port["name"], "protocol": port["protocol"], "port": 8080 + n}
        for n, port in enumerate(service["spec"]["ports"])
    ]
    name = service["metadata"]["name"]
    slices = []
    for family, addresses in (("IPv4", ENDPOINTS_4), ("IPv6", ENDPOINTS_6)):
        slices.append(
            {
                "metadata": {
                    "namespace": NAMESPACE,
                    "name": f"{name}-{family.lower()}-{'x' * (253 - len(name) - 6)}",
                    "labels": {"kubernetes.io/service-name": name},
                },
                "addressType": family,
                "ports": ports,
                "endpoints": [
                    {
                        "addresses": [address],
                        "conditions": {"ready": True, "serving": True},
                        "nodeName": NODE if n == 0 else "node-b",
                    }
                    for n, address in enumerate(addresses)
                ],
            }
        )
    return slices


def pods(node: str = NODE) -> list[Obj]:
    """Pods at the maximum name length, dual-stack, on `node`, labelled at the maximum."""
    made = []
    for index, (ipv4, ipv6) in enumerate(zip(ENDPOINTS_4, ENDPOINTS_6, strict=True)):
        made.append(
            {
                "metadata": {
                    "namespace": NAMESPACE,
                    "name": f"{POD[:-1]}{index}",
                    "uid": f"uid-{index}",
                    "labels": {LABEL_KEY: LABEL_VALUE},
                },
                "spec": {
                    "nodeName": node,
                    "containers": [
                        {
                            "name": "c" * 63,
                            "ports": [
                                {"name": PORT_NAME, "containerPort": 8080, "protocol": protocol}
                                for protocol in PROTOCOLS[:1]
                            ],
                        }
                    ],
                },
                "status": {"phase": "Running", "podIPs": [{"ip": ipv4}, {"ip": ipv6}]},
            }
        )
    return made


def namespaces() -> list[Obj]:
    return [{"metadata": {"name": NAMESPACE, "labels": {LABEL_KEY: LABEL_VALUE}}}]


def policies() -> list[Obj]:
    """A policy isolating the pods both ways, with a rule of each kind of peer and port."""
    selector = {"matchLabels": {LABEL_KEY: LABEL_VALUE}}
    peers = [
        {"podSelector": selector},
        {"namespaceSelector": selector, "podSelector": selector},
        {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16", "10.2.0.0/16"]}},
        {"ipBlock": {"cidr": "fd00::/8", "except": ["fd01::/16"]}},
    ]
    ports = [
        {"protocol": "TCP", "port": PORT_NAME},
        {"protocol": "UDP", "port": 53, "endPort": 65535},
    ]
    return [
        {
            "metadata": {"namespace": NAMESPACE, "name": POLICY},
            "spec": {
                "podSelector": selector,
                "policyTypes": ["Ingress", "Egress"],
                "ingress": [{"from": peers, "ports": ports}],
                "egress": [{"to": peers, "ports": ports}],
            },
        }
    ]


def changes(services: Iterable[tuple[Obj, list[Obj]]], node: str = NODE) -> Changes:
    """A sync's changes for Services and their slices, parsed as the daemon parses them, on a
    node of both families."""
    views = {}
    for service, slices in services:
        ports = parse_service(service)
        parsed = [s for raw in slices if (s := parse_endpoint_slice(raw)) is not None]
        meta = service["metadata"]
        views[meta["namespace"], meta["name"]] = ServiceView(
            ports, {port: endpoints_for(port, parsed) for port in ports}
        )
    return Changes(services=views, node=NodeInfo(node, addresses=("192.0.2.10", "2001:db8::10")))
