"""knit-proxyd: watches the API, syncs the datapath, serves health and metrics."""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType

from cni import install, server
from cni.errors import CniError
from cni.kernel import sysctl
from cni.kernel.errors import KernelError, SysctlError
from cni.kernel.families import IP_FAMILIES
from proxyd import allocator, gc_pause, kubeapi, watch
from proxyd.config import MODES, Config, ConfigError, conntrack_sysctls, load
from proxyd.health import ProxyHealth, ServiceHealthServers, serve_health, serve_metrics
from proxyd.iptables.chains import owned_by_kube_proxy
from proxyd.iptables.kernel import IptablesKernel
from proxyd.iptables.proxier import IptablesProxier
from proxyd.metrics import Metrics
from proxyd.model import key_of
from proxyd.nftables.kernel import Nft
from proxyd.nftables.proxier import NftablesProxier
from proxyd.nodenet import conflist, gc, kernel
from proxyd.nodenet.manager import NodeNetwork, NodeNetworkOptions
from proxyd.nodenet.routes import RouteTable
from proxyd.policy.admission import PolicyAdmission
from proxyd.policy.enforcer import PolicyEnforcer
from proxyd.policy.flow_server import FlowServer
from proxyd.policy.flow_server import socket_path as flow_server_socket
from proxyd.policy.model import pod_essentials
from proxyd.proxier import ProgramError, Proxier, ProxyOptions
from proxyd.runner import BoundedFrequencyRunner, backoff
from proxyd.tracker import ClusterState

log = logging.getLogger("knit-proxyd")

KUBE_PROXY_NFT_TABLE = "kube-proxy"
POLICY_FIRST_SYNC_WAIT = 10.0
"""How long after the proxy's first sync the clean-up that follows it waits for the policy's
first sync, at most (a sync of the proxy's after that runs it)."""
SYSCTLS_FOR_BRIDGED_PODS = (
    "net/bridge/bridge-nf-call-iptables",
    "net/bridge/bridge-nf-call-ip6tables",
)
SYSCTLS_FOR_ROUTING = ("net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding")
BRIDGE_SYSCTLS = "net/bridge"
"""Present once br_netfilter is loaded."""


def _load_br_netfilter() -> None:
    """Pods on one bridge reaching each other through a Service need their bridged replies to
    pass netfilter, or conntrack cannot undo the DNAT; kernels that build br_netfilter as a
    module (Ubuntu's, GitHub's runners') do not load it on their own, and recent Docker no
    longer does it for kind. The DaemonSet's init container loads it; the daemon's own
    container has no CAP_SYS_MODULE, so this only helps a daemon run as root on the host."""
    try:
        subprocess.run(
            ["modprobe", "br_netfilter"], check=True, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        log.warning(
            "cannot load br_netfilter (%s): a pod reaching a Service through a pod on its "
            "own node gets no answer; load it on the node (modprobe br_netfilter)",
            str(detail).strip(),
        )


def _write_sysctl(name: str, value: str) -> None:
    try:
        sysctl.write(name, value)
    except SysctlError as err:
        log.warning("%s", err.msg)


def remove_kube_proxy_nft_tables() -> int:
    """Delete the tables kube-proxy's nftables mode owns; returns how many existed."""
    return sum(Nft(family, KUBE_PROXY_NFT_TABLE).delete_table() for family in IP_FAMILIES)


def api_client(config: Config) -> kubeapi.Api:
    """The client of --kubeconfig's API server, else of the pod's service account."""
    if config.kubeconfig:
        return kubeapi.from_kubeconfig([Path(config.kubeconfig)])
    return kubeapi.in_cluster()


def _node_name(config: Config) -> str:
    return (config.hostname_override or socket.gethostname()).strip().lower()


def _options(config: Config) -> ProxyOptions:
    return ProxyOptions(
        cluster_cidrs=config.cluster_cidr,
        masquerade_all=config.masquerade_all,
        masquerade_bit=config.masquerade_bit,
        nodeport_address_cidrs=config.nodeport_address_cidrs,
        localhost_nodeports=config.localhost_nodeports,
        drop_invalid=not config.conntrack_tcp_be_liberal,
    )


def make_proxier(mode: str, config: Config, metrics: Metrics) -> Proxier:
    """The datapath of a --proxy-mode."""
    options = _options(config)
    if mode == "nftables":
        return NftablesProxier(options, IP_FAMILIES, metrics)
    if mode == "ipvs":
        # imported for this mode alone: it brings pyroute2 (IPVS, ipsets), 10.8 MiB and ~80 ms
        # that the other modes no longer pay
        from proxyd.ipvs.proxier import IpvsProxier

        return IpvsProxier(options, IP_FAMILIES, metrics, config.ipvs_scheduler)
    return IptablesProxier(options, IP_FAMILIES, metrics)


def _node_network(config: Config) -> NodeNetwork:
    options = NodeNetworkOptions(
        node_name=_node_name(config),
        routing=config.routing,
        conf_dir=Path(config.cni_conf_dir),
        data_dir=config.cni_data_dir,
        cluster_cidrs=config.cluster_cidr,
    )
    return NodeNetwork(options, [IptablesKernel(family) for family in IP_FAMILIES])


def cleanup(config: Config) -> None:
    """Remove the rules, routes and overlay device knit-proxyd installed."""
    chains = sum(make_proxier(mode, config, Metrics()).cleanup() for mode in MODES)
    chains += _policy_enforcer(config, Metrics()).cleanup()
    chains += sum(nat.remove() for nat in _node_network(config).source_nat)
    with kernel.route_socket() as sock:
        RouteTable(sock).remove_all()
    log.info("cleanup: removed %d chains/tables and knit's routes", chains)


def _policy_enforcer(config: Config, metrics: Metrics) -> PolicyEnforcer:
    return PolicyEnforcer(
        _node_name(config),
        IP_FAMILIES,
        config.sync_period,
        metrics,
        config.network_policy_log_rate,
        config.network_policy_existing_connections,
        config.flow_records_rate,
    )


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.metrics = Metrics()
        self.proxier = make_proxier(config.proxy_mode, config, self.metrics)
        self.health = ProxyHealth(self.proxier.families, timeout=2 * config.sync_period)
        self.health_servers = ServiceHealthServers(self.health)
        self.state = ClusterState(_node_name(config), on_change=self._queued)
        self.node_network = _node_network(config)
        self.policy = _policy_enforcer(config, self.metrics)
        self.runner = BoundedFrequencyRunner(self.sync, config.min_sync_period, config.sync_period)
        self.policy.on_first_sync = self._request_sync
        self.stop = threading.Event()
        self._first_synced = False
        self._first_sync_at: float | None = None
        """When the proxy's first sync succeeded (monotonic)."""
        self._failures = 0
        """Syncs that failed in a row."""
        self._retry_at = 0.0
        """After a failed sync, when its backoff lets the next one run (monotonic)."""

    def _queued(self, families: frozenset[int]) -> None:
        now = time.time()
        self.health.queued(families)
        self.health.node_deleting = self.state.node.deleting
        services, endpoints = self.state.pending()
        self.metrics.service_changes_pending.set(services)
        for family in self.proxier.families:
            metrics = self.metrics.for_family(family)
            if family in families:
                metrics.last_queued.set(now)
            metrics.endpoint_changes_pending.set(endpoints[family])
        self._request_sync()

    def _request_sync(self) -> None:
        """Ask for a sync once the first lists of Services, EndpointSlices and Nodes are in.
        One asked for before would return at once yet spend a token of the runner's burst: two
        such (the policy's first sync, a list of ServiceCIDRs) and the first real sync waits
        out the minimum interval. kube-proxy, too, syncs as soon as its lists are in, having
        read its Node at start."""
        if self.state.ready():
            self.runner.run()

    def sync(self) -> None:
        if not self.state.ready():
            log.debug("waiting for the first lists of Services, EndpointSlices and Nodes")
            return
        with gc_pause.paused():
            full = self._sync_changes()
        if full:
            gc_pause.collect_deferred()

    def _sync_changes(self) -> bool:
        """Program what changed and record it; returns whether the sync was full."""
        if time.monotonic() < self._retry_at:
            # a failed sync waits out its backoff, whatever events come meanwhile: their
            # changes stay queued for it
            return False
        changes = self.state.take()
        self.metrics.service_changes.inc(changes.service_changes)
        self.metrics.endpoint_changes.inc(changes.endpoint_changes)
        self.metrics.service_changes_pending.set(0)
        for family in self.proxier.families:
            self.metrics.for_family(family).endpoint_changes_pending.set(0)
        start = time.monotonic()
        try:
            result = self.proxier.sync(changes)
        except Exception as err:
            self._failures += 1
            delay = backoff(self._failures, max(self.config.min_sync_period, 1.0))
            log.exception("sync failed (%d in a row); a full sync in %.0f s", self._failures, delay)
            failed = err.families if isinstance(err, ProgramError) else self.proxier.families
            self.health.synced(failed=frozenset(failed))
            self._retry_at = time.monotonic() + delay
            self.runner.retry_after(delay)
            return False
        self._failures = 0
        elapsed = time.monotonic() - start
        self.health.synced()
        self.health_servers.update(result.health_checks)
        if not self._first_synced and self._settled():
            self._after_first_sync()
        log.info(
            "%s sync of %d changed services in %.1f ms",
            "full" if result.full else "partial",
            len(changes.services),
            elapsed * 1000,
        )
        return result.full

    def run(self, api: kubeapi.Api) -> None:
        self._set_sysctls()
        cni_server = self._prepare_cni()
        serve_metrics(self.config.metrics_bind_address, self.metrics, self.proxier.mode)
        policy_health = (
            (lambda: self.policy.health(self.health.timeout, time.time()))
            if self.config.network_policy
            else None
        )
        serve_health(self.config.healthz_bind_address, self.health, self.metrics, policy_health)
        reflectors = [
            watch.Reflector(
                api,
                watch.services(),
                self.state.replace_services,
                self.state.service_event,
                self.stop,
            ),
            watch.Reflector(
                api,
                watch.endpoint_slices(),
                self.state.replace_slices,
                self.state.slice_event,
                self.stop,
            ),
            watch.Reflector(api, watch.nodes(), self._replace_nodes, self._node_event, self.stop),
            watch.Reflector(
                api,
                watch.service_cidrs(),
                self.state.replace_service_cidrs,
                self.state.service_cidr_event,
                self.stop,
            ),
        ]
        flow_server = None
        if self.config.network_policy:
            reflectors += self._policy_reflectors(api)
            self.policy.start()
            if self.policy.recorder is not None and self.policy.recorder.ring is not None:
                path = flow_server_socket(self.config.cni_socket)
                try:
                    flow_server = FlowServer(path, self.policy.recorder.ring)
                except OSError as err:  # the records are still counted in the metrics
                    log.warning("cannot serve flow records on %s: %s", path, err)
        elif self.policy.cleanup():
            log.info("NetworkPolicy enforcement is off: removed the policy tables")
        for reflector in reflectors:
            reflector.start()
        self.proxier.reconciler.start()
        self.node_network.start(self.stop)
        log.info(
            "knit-proxyd (%s mode) running on node %s", self.proxier.mode, self.state.node.name
        )
        self.runner.loop()
        self.health_servers.close()
        if cni_server is not None:
            cni_server.close()
        if flow_server is not None:
            flow_server.close()

    def _policy_reflectors(self, api: kubeapi.Api) -> list[watch.Reflector]:
        state = self.policy.state
        return [
            watch.Reflector(
                api, watch.pods(pod_essentials), state.replace_pods, state.pod_event, self.stop
            ),
            watch.Reflector(
                api,
                watch.namespaces(),
                state.replace_namespaces,
                state.namespace_event,
                self.stop,
            ),
            watch.Reflector(
                api,
                watch.network_policies(),
                state.replace_policies,
                state.policy_event,
                self.stop,
            ),
            watch.Reflector(
                api,
                watch.cluster_network_policies(),
                state.replace_cluster_policies,
                state.cluster_policy_event,
                self.stop,
            ),
        ]

    def _settled(self) -> bool:
        """Whether the node's first syncs are over: the proxy's, and the policy's (or
        POLICY_FIRST_SYNC_WAIT after the proxy's), so that what comes after them does not
        hold the nf_tables lock the policy's first loads would wait for."""
        now = time.monotonic()
        if self._first_sync_at is None:
            self._first_sync_at = now
        return (
            not self.config.network_policy
            or self.policy.first_synced.is_set()
            or now - self._first_sync_at > POLICY_FIRST_SYNC_WAIT
        )

    def _after_first_sync(self) -> None:
        """Once this mode's rules are in the kernel: kube-proxy's conntrack timeouts (the
        rules have made the kernel load conntrack, whose sysctls exist only then), and what
        another --proxy-mode left removed. Not before: until the first sync, after the
        watches listed, the other mode's rules are the node's only Service rules (a switch of
        modes would leave the node without any for that long), and both at once send a
        connection to an endpoint either way."""
        self._tune_conntrack()
        self._remove_other_modes()
        self._first_synced = True

    def _remove_other_modes(self) -> None:
        """What another --proxy-mode left on this node would shadow or fight ours."""
        for mode in MODES:
            if mode != self.proxier.mode:
                removed = make_proxier(mode, self.config, Metrics()).cleanup()
                if removed:
                    log.info("removed %d objects the %s mode left behind", removed, mode)

    def _set_sysctls(self) -> None:
        if self.proxier.options.localhost_nodeports:
            _write_sysctl("net/ipv4/conf/all/route_localnet", "1")
        if not sysctl.path(BRIDGE_SYSCTLS).exists():
            _load_br_netfilter()
        if sysctl.path(BRIDGE_SYSCTLS).exists():
            for name in SYSCTLS_FOR_BRIDGED_PODS:
                _write_sysctl(name, "1")
        if self.config.routing != "none" or self.config.proxy_mode == "ipvs":
            for name in SYSCTLS_FOR_ROUTING:
                _write_sysctl(name, "1")
        if self.config.proxy_mode == "ipvs":
            from proxyd.ipvs import netlink as ipvs_netlink  # pyroute2: see make_proxier

            ipvs_netlink.load_module()
            for name in ipvs_netlink.SYSCTLS:
                _write_sysctl(name, "1")

    def _tune_conntrack(self) -> None:
        for name, value in conntrack_sysctls(self.config).items():
            _write_sysctl(name, value)

    def _prepare_cni(self) -> server.CniServer | None:
        """Install the plugin, release what pods gone since the last run held, then serve
        the plugin's fast path: in that order, so no call meets a half-ready node."""
        bin_dir = Path(self.config.cni_bin_dir)
        bundle = Path(self.config.cni_bundle) if self.config.cni_bundle else None
        if bundle is not None and bundle.is_dir():
            installed = install.install(bundle, bin_dir, self.config.cni_socket or None)
            log.info("CNI plugin installed into %s (%s)", bin_dir, installed.name)
        elif bundle is not None:
            log.warning("no CNI plugin bundle at %s: not installing the plugin", bundle)
        try:
            gc.collect(conflist.read(Path(self.config.cni_conf_dir)), bin_dir)
        except (CniError, KernelError) as err:
            log.warning("start-up IPAM garbage collection failed: %s", err.msg)
        if not self.config.cni_socket:
            return None
        hooks = PolicyAdmission(self.policy) if self.config.network_policy else None
        return server.serve(self.config.cni_socket, bin_dirs=[str(bin_dir)], hooks=hooks)

    def _replace_nodes(self, items: list[watch.Obj]) -> None:
        self.node_network.replace(items)
        own = [item for item in items if key_of(item)[1] == self.state.node.name]
        self.state.replace_node(own[0] if own else None)

    def _node_event(self, kind: str, obj: watch.Obj) -> None:
        self.node_network.event(kind, obj)
        if key_of(obj)[1] == self.state.node.name:
            self.state.node_event(kind, obj)

    def shutdown(self, signum: int, _frame: FrameType | None) -> None:
        log.info("signal %d: stopping (rules stay in place)", signum)
        self.stop.set()
        self.policy.stop()
        self.proxier.reconciler.stop()
        self.runner.stop()


def main(argv: list[str] | None = None) -> int:
    try:
        config = load(argv)
    except ConfigError as err:
        print(f"knit-proxyd: {err}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.DEBUG if config.verbosity >= 4 else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if config.cleanup:
        cleanup(config)
        return 0
    if config.cleanup_kube_proxy:
        removed = sum(
            IptablesKernel(family).remove_owned(owned_by_kube_proxy) for family in IP_FAMILIES
        )
        tables = remove_kube_proxy_nft_tables()
        log.info("removed %d chains and %d nftables tables kube-proxy left", removed, tables)
    try:
        api = api_client(config)
    except kubeapi.ConfigError as err:
        print(f"knit-proxyd: {err}", file=sys.stderr)
        return 2
    allocator.keep_sync_memory()
    daemon = Daemon(config)
    signal.signal(signal.SIGTERM, daemon.shutdown)
    signal.signal(signal.SIGINT, daemon.shutdown)
    daemon.run(api)
    return 0
