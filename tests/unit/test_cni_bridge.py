"""Bridge mode's pure parts: the routes a pod gets from IPAM's answer (no kernel involved)."""

from __future__ import annotations

import ipaddress

from cni import netconf
from cni.bridge import container_routes, gateway_interfaces
from cni.result import IPConfig, Result, Route


def ip_config(address: str, gateway: str) -> IPConfig:
    return IPConfig(ipaddress.ip_interface(address), ipaddress.ip_address(gateway))


def test_two_range_sets_of_one_family_route_through_the_first_gateway():
    conf = netconf.parse(
        {
            "cniVersion": "1.1.0",
            "name": "n",
            "type": "knit",
            "isDefaultGateway": True,
            "ipam": {"type": "host-local"},
        }
    )
    ipam = Result(
        ips=[
            ip_config("10.1.0.2/24", "10.1.0.1"),
            ip_config("fd00:1::2/64", "fd00:1::1"),
            ip_config("10.2.0.2/24", "10.2.0.1"),
            ip_config("fd00:2::2/64", "fd00:2::1"),
        ],
        routes=[Route(ipaddress.ip_network("10.99.0.0/16"))],
    )
    routes = [(str(r.dst), str(r.gw)) for r in container_routes(conf, ipam)]
    assert routes == [
        ("10.99.0.0/16", "10.1.0.1"),
        ("0.0.0.0/0", "10.1.0.1"),
        ("::/0", "fd00:1::1"),
    ]
    assert [str(g) for g in gateway_interfaces(ipam.ips)] == [
        "10.1.0.1/24",
        "fd00:1::1/64",
        "10.2.0.1/24",
        "fd00:2::1/64",
    ], "the bridge still gets every set's gateway"
