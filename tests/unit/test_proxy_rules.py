"""Rendering iptables rules from the model and the restore scripts built from them (pure)."""

from __future__ import annotations

import dataclasses

from proxyd.config import load
from proxyd.daemon import _options
from proxyd.iptables.chains import ServiceChains, owned_by_knit, owned_by_kube_proxy
from proxyd.iptables.render import ServiceRules, render_base, render_service
from proxyd.iptables.restore import RuleSet, batched_full_scripts, full_script, partial_script
from proxyd.model import Endpoint, ServicePort, ServicePortName
from proxyd.port_plan import FamilyContext, plan_port
from tests.support.example_service import CTX, NAME, PORT, READY


def rendered(
    port: ServicePort, endpoints: tuple[Endpoint, ...], ctx: FamilyContext = CTX
) -> ServiceRules:
    plan = plan_port(port, endpoints, ctx)
    return render_service(plan, ctx) if plan is not None else ServiceRules()


def rules_text(port: ServicePort, endpoints: tuple[Endpoint, ...], ctx: FamilyContext = CTX) -> str:
    ruleset = RuleSet(render_base(ctx), {port.name: rendered(port, endpoints, ctx)})
    return full_script(ruleset, {}).text()


def test_cluster_ip_spreads_over_endpoints_and_masquerades_off_cluster_sources() -> None:
    text = rules_text(PORT, READY)
    chains = ServiceChains(NAME)
    assert f"-d 10.96.0.10 --dport 80 -j {chains.cluster}" in text
    assert "! -s 10.244.0.0/16 -j KNIT-MARK-MASQ" in text
    assert "--probability 0.5000000000" in text
    assert "DNAT --to-destination 10.244.1.5:8080" in text
    assert "DNAT --to-destination 10.244.2.5:8080" in text
    assert "-j REJECT" not in text


def test_no_endpoints_rejects_in_filter() -> None:
    text = rules_text(PORT, ())
    filter_part = text.split("*filter")[1]
    assert "-d 10.96.0.10 --dport 80 -j REJECT" in filter_part
    assert "KNIT-SVC-" not in text


def test_other_family_gets_its_own_cluster_ip_and_no_foreign_endpoints() -> None:
    ctx6 = dataclasses.replace(CTX, family=6, cluster_cidr="fd10::/48")
    text = rules_text(PORT, (*READY, Endpoint("fd10::5", 8080)), ctx6)
    assert "-d fd00::10 --dport 80" in text
    assert "--to-destination [fd10::5]:8080" in text
    assert "10.244." not in text


def test_external_policy_local_drops_without_local_endpoints_but_keeps_pod_traffic() -> None:
    port = dataclasses.replace(PORT, node_port=30080, external_policy_local=True)
    remote_only = (Endpoint("10.244.2.5", 8080, node_name="node-b"),)
    text = rules_text(port, remote_only)
    chains = ServiceChains(NAME)
    assert "--dport 30080 -m addrtype --dst-type LOCAL -j DROP" in text
    assert f"-s 10.244.0.0/16 -j {chains.cluster}" in text
    assert f"-j {chains.local}" not in text


def test_source_ranges_go_through_the_firewall_chain() -> None:
    port = dataclasses.replace(
        PORT, load_balancer_ips=("203.0.113.7",), source_ranges=("198.51.100.0/24",)
    )
    text = rules_text(port, READY)
    chains = ServiceChains(NAME)
    assert f"-d 203.0.113.7 --dport 80 -j {chains.firewall}" in text
    assert f"-s 198.51.100.0/24 -j {chains.external}" in text
    assert "-d 203.0.113.7 --dport 80 -j DROP" in text.split("*filter")[1]


def test_source_ranges_of_the_other_family_leave_this_familys_lb_ips_open() -> None:
    port = dataclasses.replace(
        PORT,
        load_balancer_ips=("203.0.113.7", "2001:db8::7"),
        source_ranges=("198.51.100.0/24",),
    )
    ctx6 = dataclasses.replace(CTX, family=6, cluster_cidr="fd10::/48")
    text = rules_text(port, (Endpoint("fd10::5", 8080),), ctx6)
    chains = ServiceChains(NAME)
    assert f"-d 2001:db8::7 --dport 80 -j {chains.external}" in text
    assert chains.firewall not in text
    assert "-d 2001:db8::7 --dport 80 -j DROP" not in text


def test_affinity_uses_recent_with_the_timeout() -> None:
    port = dataclasses.replace(PORT, affinity_timeout=30)
    text = rules_text(port, READY)
    assert "--rcheck --seconds 30 --reap" in text
    assert "--set -p tcp -m tcp -j DNAT" in text


def test_partial_script_touches_only_the_changed_service() -> None:
    base = render_base(CTX)
    other = ServicePortName("ns", "other", "", "TCP")
    other_port = ServicePort(name=other, cluster_ips=("10.96.0.11",), port=53)
    old = RuleSet(
        base,
        {
            NAME: rendered(PORT, READY, CTX),
            other: rendered(other_port, READY, CTX),
        },
    )
    new = RuleSet(base, dict(old.services))
    new.services[NAME] = rendered(PORT, READY[:1], CTX)
    text = partial_script(old, new, [NAME]).text()
    assert "10.96.0.11" not in text
    assert ServiceChains(NAME).endpoint(READY[1]) in text.split("-X ")[-1]
    assert "-D KNIT-SERVICES" not in text, "the dispatch rule did not change"
    assert partial_script(old, old, [NAME, other]).empty()


def test_removed_service_deletes_its_dispatch_rule_and_chains() -> None:
    base = render_base(CTX)
    old = RuleSet(base, {NAME: rendered(PORT, READY, CTX)})
    text = partial_script(old, RuleSet(base), [NAME]).text()
    assert "-D KNIT-SERVICES" in text
    assert f"-X {ServiceChains(NAME).cluster}" in text


def test_full_script_removes_stale_owned_chains() -> None:
    ruleset = RuleSet(render_base(CTX))
    text = full_script(ruleset, {"nat": {"KNIT-SVC-STALE"}}).text()
    assert ":KNIT-SVC-STALE - [0:0]" in text and "-X KNIT-SVC-STALE" in text


def test_ownership_never_claims_the_cni_plugins_chains() -> None:
    assert owned_by_knit("KNIT-SEP-ABC") and owned_by_knit("KNIT-EXTERNAL-SERVICES")
    assert not owned_by_knit("KNIT-MASQ-0123456789")
    assert owned_by_kube_proxy("KUBE-SVC-X") and not owned_by_kube_proxy("KUBE-KUBELET-CANARY")


def test_batched_full_sync_switches_each_service_whole_and_dispatch_last() -> None:
    base = render_base(CTX)
    ruleset = RuleSet(base)
    for i in range(5):
        name = ServicePortName("ns", f"web-{i}", "http", "TCP")
        port = ServicePort(name=name, cluster_ips=(f"10.96.0.{i + 1}",), port=80)
        ruleset.services[name] = rendered(port, READY, CTX)
    scripts = batched_full_scripts(ruleset, {"nat": {"KNIT-SERVICES", "KNIT-SVC-STALE"}}, 4)
    assert len(scripts) == 7, "base, one script per service (3 chains each), shared chains"
    first, *middle, last = (script.text() for script in scripts)
    assert ":KNIT-MARK-MASQ" in first and ":KNIT-NODEPORTS" in first
    nat_first = first.split("*filter")[0]
    assert ":KNIT-SERVICES" not in nat_first, "an existing dispatch chain is not flushed early"
    for text in middle:
        assert "KNIT-SERVICES" not in text and text.count(":KNIT-SVC-") == 1
    assert ":KNIT-SERVICES" in last and "-X KNIT-SVC-STALE" in last
    single = full_script(ruleset, {}).text()
    written = [line for s in scripts for line in s.text().splitlines() if line.startswith("-A")]
    assert sorted(written) == sorted(line for line in single.splitlines() if line.startswith("-A"))
    for table in ("nat", "filter"):
        assert ruleset.chain_names(table) == ruleset.chains(table).keys()


def test_invalid_packets_are_dropped_unless_conntrack_is_liberal() -> None:
    invalid = "-A KNIT-FORWARD -m conntrack --ctstate INVALID -j DROP"
    assert invalid in rules_text(PORT, READY)
    liberal = dataclasses.replace(CTX, drop_invalid=False)
    assert invalid not in rules_text(PORT, READY, liberal)
    assert _options(load(["--conntrack-tcp-be-liberal"])).drop_invalid is False
    assert _options(load([])).drop_invalid is True
