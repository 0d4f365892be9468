"""knit-proxyd's options: kube-proxy's flags where they mean the same, and a config file in
kube-proxy's KubeProxyConfiguration form setting the same options (flags win)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from cni import ip_text
from proxyd.nodenet.route_plan import ROUTING_MODES
from proxyd.policy.cutter import CUT, EXISTING_CONNECTIONS

MODES = ("iptables", "nftables", "ipvs")
IPVS_SCHEDULERS = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "mh")
DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
CONNTRACK_TIMEOUTS = {
    "conntrack_tcp_timeout_established": "nf_conntrack_tcp_timeout_established",
    "conntrack_tcp_timeout_close_wait": "nf_conntrack_tcp_timeout_close_wait",
    "conntrack_udp_timeout": "nf_conntrack_udp_timeout",
    "conntrack_udp_timeout_stream": "nf_conntrack_udp_timeout_stream",
}
"""Config fields of kube-proxy's conntrack timeouts, and the sysctl each sets."""


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Config:
    kubeconfig: str = ""
    hostname_override: str = ""
    proxy_mode: str = "iptables"
    cluster_cidr: tuple[str, ...] = ()
    nodeport_address_cidrs: tuple[str, ...] = ()
    masquerade_all: bool = False
    masquerade_bit: int = 14
    localhost_nodeports: bool = True
    min_sync_period: float = 1.0
    sync_period: float = 30.0
    metrics_bind_address: str = "127.0.0.1:10249"
    healthz_bind_address: str = "0.0.0.0:10256"
    cleanup: bool = False
    cleanup_kube_proxy: bool = False
    verbosity: int = 0
    cni_conf_dir: str = "/etc/cni/net.d"
    cni_bin_dir: str = "/opt/cni/bin"
    cni_data_dir: str = "/var/lib/cni/networks"
    cni_socket: str = "/run/knit/cni.sock"
    cni_bundle: str = "/opt/knit/cni-bundle"
    routing: str = "auto"
    network_policy: bool = True
    network_policy_log_rate: int = 0
    flow_records_rate: int = 0
    network_policy_existing_connections: str = CUT
    ipvs_scheduler: str = "rr"
    conntrack_tcp_timeout_established: float = 86400.0
    conntrack_tcp_timeout_close_wait: float = 3600.0
    conntrack_tcp_be_liberal: bool = False
    conntrack_udp_timeout: float = 0.0
    conntrack_udp_timeout_stream: float = 0.0


def parse_duration(text: str | float) -> float:
    """Go-style durations as kube-proxy takes them: 1s, 500ms, 1m30s; a bare number is seconds."""
    if isinstance(text, int | float):
        return float(text)
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    parts = DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ConfigError(f"invalid duration {text!r}")
    return sum(float(n) * UNIT_SECONDS[u] for n, u in parts)


def _cidrs(
    values: list[str] | tuple[str, ...], what: str, allow_primary: bool = False
) -> tuple[str, ...]:
    result = []
    for value in values:
        value = value.strip()
        if not value:
            continue
        if allow_primary and value == "primary":
            result.append(value)
            continue
        try:
            result.append(str(ip_text.network(value)))
        except ValueError as err:
            raise ConfigError(f"{what}: {value!r} is not a CIDR") from err
    return tuple(result)


def _split(text: str) -> list[str]:
    return [part for part in text.split(",") if part.strip()]


def _from_file(path: str) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read config file {path}: {err}") from err
    mode = doc.get("mode") or "iptables"
    iptables = doc.get("iptables") or {}
    periods = (doc.get(mode) or {}) if mode in MODES else {}
    masquerade = (doc.get("nftables") or {}) if mode == "nftables" else iptables
    connection = doc.get("clientConnection") or {}
    conntrack = doc.get("conntrack") or {}
    mapping = {
        "kubeconfig": connection.get("kubeconfig"),
        "hostname_override": doc.get("hostnameOverride"),
        "proxy_mode": doc.get("mode") or None,
        "cluster_cidr": _split(doc["clusterCIDR"]) if doc.get("clusterCIDR") else None,
        "nodeport_address_cidrs": doc.get("nodePortAddresses"),
        "masquerade_all": masquerade.get("masqueradeAll"),
        "masquerade_bit": masquerade.get("masqueradeBit"),
        "localhost_nodeports": iptables.get("localhostNodePorts"),
        "min_sync_period": periods.get("minSyncPeriod"),
        "sync_period": periods.get("syncPeriod"),
        "ipvs_scheduler": (doc.get("ipvs") or {}).get("scheduler") or None,
        "metrics_bind_address": doc.get("metricsBindAddress"),
        "healthz_bind_address": doc.get("healthzBindAddress"),
        "conntrack_tcp_timeout_established": conntrack.get("tcpEstablishedTimeout"),
        "conntrack_tcp_timeout_close_wait": conntrack.get("tcpCloseWaitTimeout"),
        "conntrack_tcp_be_liberal": conntrack.get("tcpBeLiberal"),
        "conntrack_udp_timeout": conntrack.get("udpTimeout"),
        "conntrack_udp_timeout_stream": conntrack.get("udpStreamTimeout"),
    }
    return {key: value for key, value in mapping.items() if value is not None}


def _true(text: str) -> bool:
    """A boolean flag's value, as kube-proxy's flags take it."""
    return text.lower() in ("1", "true", "yes")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="knit-proxyd", description="knit node daemon: Kubernetes Service proxy"
    )
    p.add_argument("--config", help="KubeProxyConfiguration file; flags override it")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster config)")
    p.add_argument("--hostname-override", help="this node's name (default: the hostname)")
    p.add_argument("--proxy-mode", choices=MODES, help="datapath (default iptables)")
    p.add_argument(
        "--cluster-cidr",
        help="pod CIDR(s), comma-separated; traffic from outside "
        "them to a cluster IP is masqueraded",
    )
    p.add_argument(
        "--nodeport-addresses",
        dest="nodeport_address_cidrs",
        help="CIDRs (or 'primary') of the node addresses "
        "NodePorts answer on; default all local addresses",
    )
    p.add_argument(
        "--masquerade-all",
        action="store_const",
        const=True,
        help="masquerade all traffic sent to cluster IPs",
    )
    p.add_argument(
        "--iptables-masquerade-bit",
        type=int,
        dest="masquerade_bit",
        help="fwmark bit marking packets to masquerade (default 14)",
    )
    p.add_argument(
        "--iptables-localhost-nodeports",
        dest="localhost_nodeports",
        type=_true,
        help="answer NodePorts on 127.0.0.1 (default true)",
    )
    p.add_argument(
        "--ipvs-scheduler",
        choices=IPVS_SCHEDULERS,
        help="IPVS scheduler in ipvs mode (default rr)",
    )
    p.add_argument("--min-sync-period", help="minimum interval between syncs (default 1s)")
    p.add_argument("--sync-period", help="maximum interval between syncs (default 30s)")
    p.add_argument(
        "--conntrack-tcp-timeout-established",
        help="conntrack timeout of established TCP flows (default 24h; 0 leaves the kernel's)",
    )
    p.add_argument(
        "--conntrack-tcp-timeout-close-wait",
        help="conntrack timeout of TCP flows in CLOSE_WAIT (default 1h; 0 leaves the kernel's)",
    )
    p.add_argument(
        "--conntrack-tcp-be-liberal",
        action="store_const",
        const=True,
        help="let conntrack accept TCP packets outside the window instead of marking them INVALID",
    )
    p.add_argument(
        "--conntrack-udp-timeout", help="conntrack timeout of UDP flows (default 0: the kernel's)"
    )
    p.add_argument(
        "--conntrack-udp-timeout-stream",
        help="conntrack timeout of UDP streams (default 0: the kernel's)",
    )
    p.add_argument("--metrics-bind-address", help="default 127.0.0.1:10249")
    p.add_argument("--healthz-bind-address", help="default 0.0.0.0:10256")
    p.add_argument(
        "--cleanup",
        action="store_const",
        const=True,
        help="remove every rule this proxy installed, then exit",
    )
    p.add_argument(
        "--cleanup-kube-proxy",
        action="store_const",
        const=True,
        help="remove kube-proxy's leftover KUBE-* rules at start-up",
    )
    p.add_argument("-v", "--v", type=int, dest="verbosity", help="log verbosity (0-4)")
    node = p.add_argument_group("node networking (knit's own; kube-proxy has none)")
    node.add_argument("--cni-conf-dir", help="where 10-knit.conflist goes (/etc/cni/net.d)")
    node.add_argument("--cni-bin-dir", help="where the plugin is installed (/opt/cni/bin)")
    node.add_argument("--cni-data-dir", help="host-local's dataDir (/var/lib/cni/networks)")
    node.add_argument(
        "--cni-socket", help="the plugin's fast-path socket (/run/knit/cni.sock; '' for none)"
    )
    node.add_argument(
        "--cni-bundle",
        help="the plugin bundle to install into --cni-bin-dir (/opt/knit/cni-bundle; '' for none)",
    )
    node.add_argument(
        "--routing",
        choices=ROUTING_MODES,
        help="routes to other nodes' pods: direct via their InternalIP, vxlan, auto "
        "(direct to neighbours on the same segment, vxlan to the rest; default) or none",
    )
    node.add_argument(
        "--network-policy",
        type=_true,
        help="enforce NetworkPolicies for this node's pods (default true)",
    )
    node.add_argument(
        "--network-policy-log-rate",
        type=int,
        help="log at most this many denied packets a second per IP family (default 0: none)",
    )
    node.add_argument(
        "--flow-records-rate",
        type=int,
        help="record at most this many new connections a second per IP family, with the "
        "policy rule that decided each, for `kubectl knit flows` (default 0: none; 1000 "
        "recommended)",
    )
    node.add_argument(
        "--network-policy-existing-connections",
        choices=EXISTING_CONNECTIONS,
        help="what a policy change does to open connections it no longer allows: cut them "
        "(default) or keep them open",
    )
    return p


def load(argv: list[str] | None = None) -> Config:
    args = parser().parse_args(argv)
    values: dict[str, Any] = _from_file(args.config) if args.config else {}
    flags = vars(args)
    for field in fields(Config):
        if flags.get(field.name) is not None:
            values[field.name] = flags[field.name]
    if isinstance(values.get("cluster_cidr"), str):
        values["cluster_cidr"] = _split(values["cluster_cidr"])
    if isinstance(values.get("nodeport_address_cidrs"), str):
        values["nodeport_address_cidrs"] = _split(values["nodeport_address_cidrs"])
    values["cluster_cidr"] = _cidrs(values.get("cluster_cidr", ()), "--cluster-cidr")
    values["nodeport_address_cidrs"] = _cidrs(
        values.get("nodeport_address_cidrs", ()), "--nodeport-addresses", allow_primary=True
    )
    for name in ("min_sync_period", "sync_period", *CONNTRACK_TIMEOUTS):
        if name in values:
            values[name] = parse_duration(values[name])
    config = Config(**values)
    if config.proxy_mode not in MODES:
        raise ConfigError(f"proxy mode {config.proxy_mode!r} is not supported (one of {MODES})")
    if config.ipvs_scheduler not in IPVS_SCHEDULERS:
        raise ConfigError(
            f"IPVS scheduler {config.ipvs_scheduler!r} is not one of {IPVS_SCHEDULERS}"
        )
    if not 0 <= config.masquerade_bit <= 31:
        raise ConfigError("--iptables-masquerade-bit must be within 0..31")
    if config.sync_period <= 0 or config.min_sync_period < 0:
        raise ConfigError("sync periods must be positive")
    if config.network_policy_log_rate < 0:
        raise ConfigError("--network-policy-log-rate must not be negative")
    if config.flow_records_rate < 0:
        raise ConfigError("--flow-records-rate must not be negative")
    if any(getattr(config, name) < 0 for name in CONNTRACK_TIMEOUTS):
        raise ConfigError("conntrack timeouts must not be negative")
    return config


def conntrack_sysctls(config: Config) -> dict[str, str]:
    """The conntrack sysctls kube-proxy sets from its conntrack options (a timeout of 0
    leaves the kernel's value; tcpBeLiberal only ever turns liberal mode on)."""
    wanted = {
        f"net/netfilter/{sysctl}": str(int(getattr(config, name)))
        for name, sysctl in CONNTRACK_TIMEOUTS.items()
        if getattr(config, name) > 0
    }
    if config.conntrack_tcp_be_liberal:
        wanted["net/netfilter/nf_conntrack_tcp_be_liberal"] = "1"
    return wanted
