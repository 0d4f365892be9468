"""The daemon's options: flags, the config file, durations, node port addresses (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cni.kernel.addresses import LinkAddress
from proxyd.addresses import nodeport_addresses
from proxyd.config import ConfigError, conntrack_sysctls, load, parse_duration
from proxyd.model import NodeInfo, parse_node


def test_durations_as_kube_proxy_takes_them() -> None:
    assert parse_duration("1m30s") == 90
    assert parse_duration("250ms") == 0.25
    with pytest.raises(ConfigError):
        parse_duration("10 parsecs")


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    config_file = tmp_path / "proxy.yaml"
    config_file.write_text(
        "apiVersion: kubeproxy.config.k8s.io/v1alpha1\nkind: KubeProxyConfiguration\n"
        "clusterCIDR: 10.244.0.0/16,fd10::/48\nmetricsBindAddress: 127.0.0.1:9999\n"
        "iptables:\n  masqueradeAll: true\n  minSyncPeriod: 2s\n"
    )
    config = load(["--config", str(config_file), "--metrics-bind-address", "127.0.0.1:1"])
    assert config.cluster_cidr == ("10.244.0.0/16", "fd10::/48")
    assert config.masquerade_all and config.min_sync_period == 2
    assert config.metrics_bind_address == "127.0.0.1:1"
    assert config.healthz_bind_address == "0.0.0.0:10256"


def test_bad_options_are_refused() -> None:
    with pytest.raises(ConfigError):
        load(["--cluster-cidr", "10.244.0.0/99"])
    with pytest.raises(ConfigError):
        load(["--iptables-masquerade-bit", "40"])


def unasked() -> list[LinkAddress]:
    raise AssertionError("the node's addresses are read only for a CIDR of the family")


def test_nodeport_addresses_primary_is_the_first_node_ip_of_the_family() -> None:
    node = NodeInfo("node-a", addresses=("192.0.2.10", "192.0.2.11", "fd00::10", "fd00::11"))
    assert nodeport_addresses(("primary",), 4, node, unasked) == ("192.0.2.10",)
    assert nodeport_addresses(("primary",), 6, node, unasked) == ("fd00::10",)
    v4_only = NodeInfo("node-b", addresses=("192.0.2.12",))
    no_primary = nodeport_addresses(("primary",), 6, v4_only, unasked)
    assert no_primary is None, "no IPv6 primary: every address"
    no_cidr = nodeport_addresses(("192.0.2.0/24",), 6, node, unasked)
    assert no_cidr is None, "no IPv6 CIDR: every address"
    assert nodeport_addresses((), 4, node, unasked) is None
    on_links = [
        LinkAddress(1, "127.0.0.1", 8, 254),
        LinkAddress(2, "192.0.2.10", 24, 0),
        LinkAddress(3, "198.51.100.1", 24, 0),
    ]
    in_cidr = nodeport_addresses(("192.0.2.0/24", "primary"), 4, node, lambda: on_links)
    assert in_cidr == ("192.0.2.10",)
    external_only_v4 = parse_node(
        {
            "metadata": {"name": "node-c"},
            "status": {
                "addresses": [
                    {"type": "ExternalIP", "address": "203.0.113.9"},
                    {"type": "InternalIP", "address": "fd00::9"},
                ]
            },
        }
    )
    assert nodeport_addresses(("primary",), 4, external_only_v4, unasked) == ("203.0.113.9",)
    assert nodeport_addresses(("primary",), 6, external_only_v4, unasked) == ("fd00::9",)


def test_conntrack_options_as_kube_proxy_takes_them(tmp_path: Path) -> None:
    assert conntrack_sysctls(load([])) == {
        "net/netfilter/nf_conntrack_tcp_timeout_established": "86400",
        "net/netfilter/nf_conntrack_tcp_timeout_close_wait": "3600",
    }
    config_file = tmp_path / "proxy.yaml"
    config_file.write_text(
        "conntrack:\n  tcpEstablishedTimeout: 0s\n  tcpCloseWaitTimeout: 1h0m0s\n"
        "  tcpBeLiberal: true\n  udpTimeout: 30s\n"
    )
    config = load(["--config", str(config_file), "--conntrack-udp-timeout-stream", "2m"])
    assert conntrack_sysctls(config) == {
        "net/netfilter/nf_conntrack_tcp_timeout_close_wait": "3600",
        "net/netfilter/nf_conntrack_udp_timeout": "30",
        "net/netfilter/nf_conntrack_udp_timeout_stream": "120",
        "net/netfilter/nf_conntrack_tcp_be_liberal": "1",
    }
    with pytest.raises(ConfigError):
        load(["--conntrack-tcp-timeout-close-wait=-1s"])


def test_network_policy_flags() -> None:
    assert load([]).network_policy and load([]).network_policy_log_rate == 0
    off = load(["--network-policy=false", "--network-policy-log-rate", "10"])
    assert not off.network_policy and off.network_policy_log_rate == 10
    with pytest.raises(ConfigError):
        load(["--network-policy-log-rate", "-1"])


def test_flow_records_are_off_unless_given_a_rate() -> None:
    assert load([]).flow_records_rate == 0
    assert load(["--flow-records-rate", "100"]).flow_records_rate == 100
    with pytest.raises(ConfigError):
        load(["--flow-records-rate", "-1"])
