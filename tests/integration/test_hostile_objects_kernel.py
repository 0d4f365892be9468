"""Objects at the API server's limits (tests/support/hostile_objects.py) render into text the kernel
takes: every proxy mode this kernel has, both families, and the policy tables. A name that
passes a kernel limit must be hashed, never make the node's whole sync fail."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest

from deploy.lab.netns import Netns
from proxyd.iptables import proxier as iptables_proxier
from proxyd.iptables import render as iptables_render
from proxyd.iptables.proxier import IptablesProxier
from proxyd.iptables.render import ServiceRules
from proxyd.metrics import Metrics
from proxyd.nftables import render as nftables_render
from proxyd.nftables.proxier import NftablesProxier
from proxyd.nftables.render import PortContext, ServiceObjects
from proxyd.policy import render as policy_render
from proxyd.policy.enforcer import PolicyEnforcer
from proxyd.policy.quarantine import QUARANTINED
from proxyd.port_plan import FamilyContext, PortPlan
from proxyd.proxier import Proxier, ProxyOptions
from proxyd.tracker import Changes
from tests.support import hostile_objects

OPTIONS = ProxyOptions(cluster_cidrs=("10.244.0.0/16", "fd10::/48"))
FAMILIES = (4, 6)


def changes() -> Changes:
    return hostile_objects.changes(
        (service, hostile_objects.endpoint_slices(service))
        for service in hostile_objects.services()
    )


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


def test_a_pod_whose_rules_nft_refuses_is_quarantined_and_the_rest_load(
    make_netns: Callable[[str], Netns], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal knit had for a long pod name, brought back: that pod drops all, and the
    node's other pods keep their rules."""
    monkeypatch.setattr(policy_render, "NFT_COMMENT_MAX", 1000)
    ns = make_netns("knit-hostile")
    short = {
        **hostile_objects.pods()[1],
        "metadata": {**hostile_objects.pods()[1]["metadata"], "name": "short", "uid": "short"},
    }
    enforcer = PolicyEnforcer(hostile_objects.NODE, (4,), 3600.0, Metrics())
    state = enforcer.state
    state.replace_namespaces(hostile_objects.namespaces())
    state.replace_pods([hostile_objects.pods()[0], short])
    state.replace_policies(hostile_objects.policies())
    state.replace_cluster_policies([])
    with ns.entered():
        enforcer.sync()
    enforcer.stop()
    written = enforcer._written[4]
    assert written is not None, "the table was written"
    long_chain, short_chain = written.ingress["10.244.1.5"], written.ingress["10.244.2.5"]
    assert written.quarantined == {long_chain, written.egress["10.244.1.5"]}
    listing = ns.run("nft", "list", "table", "ip", "knit-policy").stdout
    quarantined = listing.split(f"chain {long_chain} {{")[1].split("}")[0]
    assert QUARANTINED in quarantined and "drop" in quarantined and "accept" not in quarantined
    kept = listing.split(f"chain {short_chain} {{")[1].split("}")[0]
    assert f"{hostile_objects.NAMESPACE}/short" in kept and "accept" in kept


def poisoned_iptables(plan: PortPlan, ctx: FamilyContext) -> ServiceRules:
    rules = iptables_render.render_service(plan, ctx)
    if plan.port.name.name == POISONED:
        rules.chains["KNIT-POISON"] = ("-m no-such-match -j ACCEPT",)
    return rules


def poisoned_nftables(plan: PortPlan, ctx: PortContext) -> ServiceObjects:
    objects = nftables_render_service(plan, ctx)
    if plan.port.name.name == POISONED:
        objects.chains["poison"] = ("ip daddr 10.0.0.1 no-such-statement",)
    return objects


POISONED = f"{hostile_objects.SERVICE[:-1]}1"
nftables_render_service = nftables_render.render_service


@pytest.mark.parametrize("proxier", [IptablesProxier, NftablesProxier])
def test_a_service_whose_rules_the_kernel_refuses_is_left_out_and_the_rest_served(
    proxier: Callable[[ProxyOptions, tuple[int, ...], Metrics], Proxier],
    make_netns: Callable[[str], Netns],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A refusal brought in for one Service (a rule the kernel does not know, added to what
    it renders): its ports are left out and logged, the other Services' are written."""
    monkeypatch.setattr(iptables_proxier, "render_service", poisoned_iptables)
    monkeypatch.setattr(nftables_render, "render_service", poisoned_nftables)
    ns = make_netns("knit-hostile")
    metrics = Metrics()
    with ns.entered(), caplog.at_level(logging.ERROR):
        made = proxier(OPTIONS, FAMILIES, metrics)
        made.sync(changes())
    listing = ns.run("nft", "list", "ruleset").stdout
    assert "10.96.0.10" in listing and "10.96.0.12" in listing, "the other Services written"
    assert "10.96.0.11" not in listing and "fd00::11" not in listing, "the refused one left out"
    assert f"Service port {hostile_objects.NAMESPACE}/{POISONED}:" in caplog.text
    for family in ("IPv4", "IPv6"):
        refused = metrics.registry.get_sample_value(
            "knit_sync_proxy_rules_refused_service_ports", {"ip_family": family}
        )
        assert refused == len(hostile_objects.PROTOCOLS), "every port of the Service"

    caplog.clear()
    with ns.entered(), caplog.at_level(logging.ERROR):
        made.sync(changes())
    assert "refused" not in caplog.text, "left out while unchanged: no refusal again"
