"""Objects at the API server's limits (tests/hostile_objects.py) render into text the kernel
takes: every proxy mode this kernel has, both families, and the policy tables. A name that
passes a kernel limit must be hashed, never make the node's whole sync fail."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from deploy.lab.netns import Netns
from proxyd.iptables.proxier import IptablesProxier
from proxyd.metrics import Metrics
from proxyd.model import (
    NodeInfo,
    endpoints_for,
    parse_endpoint_slice,
    parse_service,
)
from proxyd.nftables.proxier import NftablesProxier
from proxyd.policy.enforcer import PolicyEnforcer
from proxyd.proxier import Proxier, ProxyOptions
from proxyd.tracker import Changes, ServiceView
from tests import hostile_objects

OPTIONS = ProxyOptions(cluster_cidrs=("10.244.0.0/16", "fd10::/48"))
FAMILIES = (4, 6)


def changes() -> Changes:
    views = {}
    for service in hostile_objects.services():
        ports = parse_service(service)
        slices = [
            parsed
            for obj in hostile_objects.endpoint_slices(service)
            if (parsed := parse_endpoint_slice(obj)) is not None
        ]
        meta = service["metadata"]
        views[meta["namespace"], meta["name"]] = ServiceView(
            ports, {port: endpoints_for(port, slices) for port in ports}
        )
    node = NodeInfo(hostile_objects.NODE, addresses=("192.0.2.10", "2001:db8::10"))
    return Changes(services=views, node=node)


@pytest.mark.parametrize("proxier", [IptablesProxier, NftablesProxier])
def test_services_at_the_api_limits_sync_in_every_mode(
    proxier: Callable[[ProxyOptions, tuple[int, ...], Metrics], Proxier],
    make_netns: Callable[[str], Netns],
) -> None:
    ns = make_netns("knit-hostile")
    with ns.entered():
        result = proxier(OPTIONS, FAMILIES, Metrics()).sync(changes())
    assert result.full
    listing = ns.run("nft", "list", "ruleset").stdout
    for address in ("10.244.1.5", "fd10:ffff:ffff:ffff:ffff:ffff:ffff:5"):
        assert address in listing, f"{address}: the endpoint reached the kernel"


def test_policies_and_pods_at_the_api_limits_load_whole(make_netns: Callable[[str], Netns]) -> None:
    ns = make_netns("knit-hostile")
    enforcer = PolicyEnforcer(hostile_objects.NODE, FAMILIES, 3600.0, Metrics())
    state = enforcer.state
    state.replace_namespaces(hostile_objects.namespaces())
    state.replace_pods(hostile_objects.pods())
    state.replace_policies(hostile_objects.policies())
    state.replace_cluster_policies([])
    with ns.entered():
        enforcer.sync()
    enforcer.stop()
    for family, address in ((4, "10.244.1.5"), (6, "fd10:ffff:ffff:ffff:ffff:ffff:ffff:5")):
        table = "ip" if family == 4 else "ip6"
        listing = ns.run("nft", "list", "map", table, "knit-policy", "ingress-pods").stdout
        assert address in listing, f"IPv{family}: the pod is isolated in the kernel"
