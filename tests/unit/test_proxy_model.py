"""Parsing API objects into the proxy's model, and the choice of endpoints (pure code)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from proxyd.model import (
    DEFAULT_AFFINITY_TIMEOUT,
    Endpoint,
    InvalidObject,
    NodeInfo,
    endpoints_for,
    parse_endpoint_slice,
    parse_node,
    parse_service,
)
from proxyd.topology import categorize


def service(**spec: Any) -> dict[str, Any]:
    base = {"clusterIPs": ["10.96.0.10"], "ports": [{"name": "http", "port": 80}]}
    return {"metadata": {"namespace": "ns", "name": "web"}, "spec": {**base, **spec}}


def endpoint_slice(
    endpoints: list[dict[str, Any]],
    ports: list[dict[str, Any]] | None = None,
    name: str = "web-1",
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "ns",
            "name": name,
            "labels": {"kubernetes.io/service-name": "web"},
        },
        "addressType": address_type,
        "ports": ports
        if ports is not None
        else [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def test_service_ports_and_defaults() -> None:
    (port,) = parse_service(service(sessionAffinity="ClientIP"))
    assert str(port.name) == "ns/web:http"
    assert port.protocol == "TCP" and port.port == 80
    assert port.affinity_timeout == DEFAULT_AFFINITY_TIMEOUT


def test_headless_and_external_name_get_no_ports() -> None:
    assert parse_service(service(clusterIPs=["None"], clusterIP="None")) == []
    assert parse_service(service(type="ExternalName", externalName="example.com")) == []


@pytest.mark.parametrize(
    "spec",
    [
        {"ports": [{"name": "a", "port": 70000}]},
        {"ports": [{"name": "a", "port": 80, "protocol": "ICMP"}]},
        {"ports": [{"name": "a", "port": 80}, {"name": "a", "port": 81}]},
        {"clusterIPs": ["10.96.0.300"]},
        {"loadBalancerSourceRanges": ["10.0.0.0/33"]},
    ],
)
def test_bad_services_are_rejected_with_a_reason(spec: dict[str, Any]) -> None:
    with pytest.raises(InvalidObject):
        parse_service(service(**spec))


def test_a_bad_external_or_ingress_ip_is_skipped_alone(caplog: pytest.LogCaptureFixture) -> None:
    obj = service(externalIPs=["nope", "192.0.2.7"])
    obj["status"] = {"loadBalancer": {"ingress": [{"ip": "203.0.113.300"}, {"ip": "203.0.113.1"}]}}
    with caplog.at_level(logging.WARNING):
        (port,) = parse_service(obj)
    assert port.external_ips == ("192.0.2.7",)
    assert port.load_balancer_ips == ("203.0.113.1",)
    assert "Service ns/web: skipping externalIP 'nope'" in caplog.text


def test_lb_ingress_proxy_mode_gets_no_vip() -> None:
    obj = service(type="LoadBalancer")
    obj["status"] = {
        "loadBalancer": {
            "ingress": [{"ip": "203.0.113.1"}, {"ip": "203.0.113.2", "ipMode": "Proxy"}]
        }
    }
    assert parse_service(obj)[0].load_balancer_ips == ("203.0.113.1",)


def test_slice_conditions_default_and_wrong_family() -> None:
    parsed = parse_endpoint_slice(endpoint_slice([{"addresses": ["10.0.0.1"]}]))
    assert parsed is not None
    assert parsed.endpoints[0].ready and parsed.endpoints[0].serving
    assert not parsed.endpoints[0].terminating
    mixed = endpoint_slice(
        [{"addresses": ["fd00::1"]}, {"addresses": ["10.0.0.300"]}, {"addresses": ["10.0.0.2"]}]
    )
    parsed = parse_endpoint_slice(mixed)
    assert parsed is not None and [e.ip for e in parsed.endpoints] == ["10.0.0.2"]
    assert parse_endpoint_slice(endpoint_slice([], address_type="FQDN")) is None


def test_endpoints_without_hints_share_one_empty_set_and_hints_are_read() -> None:
    parsed = parse_endpoint_slice(
        endpoint_slice(
            [
                {"addresses": ["10.0.0.1"]},
                {"addresses": ["10.0.0.2"], "hints": {"forZones": [{"name": "zone-a"}]}},
                {"addresses": ["10.0.0.3"], "hints": {"forNodes": [{"name": "node-a"}]}},
            ]
        )
    )
    assert parsed is not None
    plain, zoned, noded = parsed.endpoints
    assert plain.zone_hints is plain.node_hints is zoned.node_hints is noded.zone_hints
    assert not plain.zone_hints
    assert zoned.zone_hints == {"zone-a"} and noded.node_hints == {"node-a"}


def test_named_port_matches_by_name_and_protocol() -> None:
    (port,) = parse_service(service())
    slices = [
        parse_endpoint_slice(
            endpoint_slice([{"addresses": ["10.0.0.1"]}], [{"name": "http", "port": 8080}])
        ),
        parse_endpoint_slice(
            endpoint_slice(
                [{"addresses": ["10.0.0.2"]}],
                [{"name": "http", "port": 9090, "protocol": "UDP"}],
                name="web-2",
            )
        ),
    ]
    endpoints = endpoints_for(port, [s for s in slices if s])
    assert [(e.ip, e.port) for e in endpoints] == [("10.0.0.1", 8080)]


def test_duplicate_address_prefers_the_non_terminating_entry() -> None:
    (port,) = parse_service(service())
    terminating = {"addresses": ["10.0.0.1"], "conditions": {"ready": False, "terminating": True}}
    slices = [
        parse_endpoint_slice(endpoint_slice([terminating])),
        parse_endpoint_slice(endpoint_slice([{"addresses": ["10.0.0.1"]}], name="web-2")),
    ]
    (endpoint,) = endpoints_for(port, [s for s in slices if s])
    assert endpoint.ready and not endpoint.terminating


NODE = NodeInfo("node-a", zone="zone-a")


def ep(ip: str, **kw: Any) -> Endpoint:
    return Endpoint(ip=ip, port=80, **kw)


def test_terminating_fallback_only_when_nothing_is_ready() -> None:
    (port,) = parse_service(service())
    ready = ep("10.0.0.1")
    serving_terminating = ep("10.0.0.2", ready=False, serving=True, terminating=True)
    not_serving = ep("10.0.0.3", ready=False, serving=False, terminating=True)
    assert categorize(port, (ready, serving_terminating), NODE).cluster == (ready,)
    assert categorize(port, (serving_terminating, not_serving), NODE).cluster == (
        serving_terminating,
    )
    assert categorize(port, (not_serving,), NODE).cluster == ()


def test_topology_hints_used_only_when_complete_and_matching() -> None:
    (port,) = parse_service(service())
    here = ep("10.0.0.1", zone_hints=frozenset({"zone-a"}))
    there = ep("10.0.0.2", zone_hints=frozenset({"zone-b"}))
    unhinted = ep("10.0.0.3")
    assert categorize(port, (here, there), NODE).cluster == (here,)
    assert categorize(port, (here, there, unhinted), NODE).cluster == (here, there, unhinted)
    assert categorize(port, (there,), NODE).cluster == (there,)
    by_node = ep("10.0.0.4", node_hints=frozenset({"node-a"}))
    other_node = ep("10.0.0.5", node_hints=frozenset({"node-b"}))
    assert categorize(port, (by_node, other_node), NODE).cluster == (by_node,)


def test_local_policies_use_local_endpoints_and_ignore_hints() -> None:
    (port,) = parse_service(service(internalTrafficPolicy="Local"))
    local = ep("10.0.0.1", node_name="node-a", zone_hints=frozenset({"zone-b"}))
    remote = ep("10.0.0.2", node_name="node-b", zone_hints=frozenset({"zone-a"}))
    chosen = categorize(port, (local, remote), NODE)
    assert chosen.local == (local,) and chosen.cluster == () and chosen.any_usable
    assert categorize(port, (remote,), NODE).local == ()
    (both_local,) = parse_service(
        service(
            type="NodePort",
            internalTrafficPolicy="Local",
            externalTrafficPolicy="Local",
            ports=[{"name": "http", "port": 80, "nodePort": 30080}],
        )
    )
    here, there = ep("10.0.0.1", node_name="node-a"), ep("10.0.0.2", node_name="node-b")
    chosen = categorize(both_local, (here, there), NODE)
    assert chosen.local == (here,) and chosen.cluster == (here, there), (
        "an external frontend's pod and node traffic goes to every endpoint"
    )


def test_node_addresses_internal_first_and_deletion_by_timestamp_or_autoscaler_taint() -> None:
    def node(**extra: Any) -> dict[str, Any]:
        addresses = [
            {"type": "ExternalIP", "address": "203.0.113.4"},
            {"type": "Hostname", "address": "node-a"},
            {"type": "InternalIP", "address": "fd00::4"},
            {"type": "InternalIP", "address": "not-an-ip"},
        ]
        return {"metadata": {"name": "node-a"}, "status": {"addresses": addresses}, **extra}

    parsed = parse_node(node())
    assert parsed.addresses == ("fd00::4", "203.0.113.4") and not parsed.deleting
    tainted = node(
        spec={"taints": [{"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}
    )
    assert parse_node(tainted).deleting
    other_taint = node(spec={"taints": [{"key": "node.kubernetes.io/unschedulable"}]})
    assert not parse_node(other_taint).deleting
    deleted = node()
    deleted["metadata"]["deletionTimestamp"] = "2026-11-22T10:00:00Z"
    assert parse_node(deleted).deleting
