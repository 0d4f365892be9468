"""knit-proxyd's iptables and nftables modes at scale, side by side, each figure beside an
anchor measured in the same run.

A real etcd + kube-apiserver on host loopback holds N Services (one TCP port each), each with
an EndpointSlice of 10 endpoints on another node. For each N and each mode (--modes, default
both), knit-proxyd starts in a fresh node namespace (with the tests' flags: its CNI files in
the run's folder, no routing) and is measured:

- full sync: the daemon's own metric (exactly one full sync at start, which writes both
  families, the IPv6 rules being the fixed part only), against a bare load of exactly the rules
  it wrote, in both families, into a fresh namespace, from a thread inside that namespace
  (iptables: through the daemon's own wrapper, `restore --noflush` of iptables-save of its nat and
  filter tables, then the same in IPv6, on the nft flavour in batches of the daemon's chains per
  restore; nftables: an `nft -f` process (the daemon runs libnftables in its own process) of
  `nft list table ip knit` and `... ip6 knit`, one transaction, where the daemon writes each
  table, which has no chains yet, in chunks loaded while the next is made, and at steady state
  one transaction that nft parses while the rest is made); the wall time from its start to the
  rules being in the kernel, and the start-up before the full sync (wall minus metric); then
  full syncs at steady state (forced by changing the Node's zone, medians of several) against
  bare reloads of the same rules over themselves (nftables: `delete table` of both and the
  listings, in one transaction: nft's `flush table` empties the chains but leaves every set
  and map element in place, so a reload after it would only re-add what is there, where the
  daemon's full sync replaces the maps' contents);
- its resident memory (VmRSS of the interpreter);
- one-service changes (one endpoint of one EndpointSlice replaced): the partial sync's own
  metric against a bare load of the same change, rendered by the daemon's code in the context
  its proxier builds for the node (and checked to leave the anchor's chain equal to the
  daemon's), and the latency from the PATCH returning to the new endpoint being in the kernel,
  by the daemon's last-sync timestamp; in separate changes, when a look is cheap, also polled
  from outside (`iptables -S <chain>` / `nft list chain ip knit <chain>`), so the metric
  samples of both modes are taken alike;

and at the largest N:

- TCP connections per second (sequential connect + reset) from a client namespace to a
  ClusterIP (iptables: the one whose rule is the last service rule of KNIT-SERVICES; nftables:
  the same service, any one costs one verdict-map lookup), against two directs: the backend
  reached through a node namespace without any rules (the goal's), and the backend reached
  directly through the same node; and against the least a NAT datapath does, a node whose
  only rule is one verdict-map lookup DNATing the same address to the same endpoints (the
  connection tracking every NAT needs, without anything of knit's), itself measured against
  direct through a node without rules: the floor the goal sits on. The loads take turns, a
  round being one run of each, back to back, each round starting one load further on; a
  ratio is the median of the rounds' own ratios, so that the machine's slower and faster
  spells (+-20% here) fall on both of its sides.

After knit-proxyd, at each N and in each mode, the real kube-proxy (built from the pinned
kubernetes module) starts in a fresh node namespace of the same layout, against the same API
server and objects, and the figures both can give are taken of it the same way, from its own
metrics under the same names: cold start to its first full sync done, the full sync at start
and forced at steady state, one-service changes (its partial sync, and from the PATCH to the
rules in the kernel by the network programming metric: every change the bench makes stamps
the EndpointSlice's last-change-trigger-time, as the EndpointSlice controller does), resident
memory after start and at peak, the CPU time each daemon spends over a churn of 1,000
endpoint changes, and at the largest N connections/s through the same ClusterIP as a share of
direct through a node without rules. Each becomes a row beside knit-proxyd's, with the ratio.

The run ends with every figure as measured, then a table comparing the modes per N with the
nftables mode's goals marked met or not: connections through a ClusterIP at the largest N at
least 80% of direct through a node without rules, a one-service change under 20 ms whose
partial sync does not grow from the smallest N to the largest (at most 1.5x, printed beside
the bare tool's growth), and full syncs at most 1.5x the bare `nft -f`; beside kube-proxy at
the largest N, knit-proxyd at or ahead of it on every figure, and a one-service change at most
a tenth of its. The figures beside kube-proxy are also drawn as a PNG next to the result file
(bench/chart.py).

That a sync ended is read from the line the daemon logs after it; its metrics are read once
then, not polled during the sync they measure (a look costs a process, ~11 ms of CPU here).

`--flavour legacy` makes the node look like one whose kubelet uses iptables-legacy (kubelet's
hint chain), so the iptables mode detects and uses legacy; by default it detects nft, as on
any fresh node here. A first full sync that takes longer than --sync-timeout ends that size.

Run as root from the repository root (~25 minutes on a 2-core VM, 2-3 of them creating the
20,000 objects):
  .venv/bin/python -m bench.proxy_bench [--sizes 1000,10000] [--modes iptables,nftables]
      [--flavour nft|legacy] [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import pstats
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client, config

from bench import chart, record
from bench.proxy_daemon import (
    FULL,
    KNIT,
    KUBE_PROXY,
    LAST_SYNC,
    METRICS_ADDRESS,
    PARTIAL,
    PENDING,
    TRIGGER_TIME,
    Daemon,
    programming,
    spent,
)
from cni.families import IP_FAMILIES
from cni.firewall import detect_iptables_flavour
from deploy.lab.controlplane import ControlPlane, NetnsForward, die_with_parent, start
from deploy.lab.kube import (
    SERVICES,
    SLICES,
    Kube,
    endpoint,
    node_object,
    service_object,
    slice_object,
)
from deploy.lab.netns import Netns, namespaces
from deploy.lab.process import eventually, exit_on_termination
from deploy.lab.proxyd_node import NodeFiles, proxyd_flags
from proxyd.config import load as load_config
from proxyd.daemon import make_proxier
from proxyd.iptables import render as iptables_render
from proxyd.iptables.chains import ServiceChains
from proxyd.iptables.kernel import BUILTIN_CHAINS, JUMP, IptablesKernel
from proxyd.iptables.proxier import NFT_CHAINS_PER_RESTORE
from proxyd.iptables.restore import RuleSet, Script, partial_script
from proxyd.metrics import Metrics
from proxyd.model import ZONE_LABEL, Endpoint, ServicePort, ServicePortName, parse_node
from proxyd.nftables import render as nftables_render
from proxyd.nftables.kernel import CHAIN_LINE, Nft
from proxyd.nftables.transaction import GENERATION_SUFFIXES, TableState, partial_transaction
from proxyd.port_plan import FamilyContext, PortPlan, plan_port

NODE = "bench-node"
NODE_ADDRESS = "198.18.0.1"
REMOTE_NODE = "node-elsewhere"
"""The node every service's endpoints are on: not this one, so no rule is local."""
CLUSTER_CIDR = "10.244.0.0/16"
PORT, TARGET_PORT = 80, 8080
ENDPOINTS = 10
SLICE_PORTS = [{"name": "", "port": TARGET_PORT, "protocol": "TCP"}]
CLIENT, CLIENT_GATEWAY = "10.244.200.2", "10.244.200.1"
BACKEND_GATEWAY = "10.244.201.1"
BACKENDS = [f"10.244.201.{host}" for host in range(2, 3 + ENDPOINTS)]
"""The target service's endpoints, and one more address for the direct connections."""
WORKERS = 16
LEGACY_HINT = "KUBE-IPTABLES-HINT"
OUTSIDE_POLL_LIMIT = 0.05
"""Seconds one look at the kernel may cost to be polled during a change (legacy: ~0.8 s at
10,000 services, holding the xtables lock the daemon's restore waits for)."""
FORCED_FULL_LIMIT = 120.0
"""No forced full sync at steady state when the first one took longer than this (seconds)."""
FULL_SYNC_GOAL = 1.5
"""nftables: a full sync costs at most this many bare `nft -f` of the same rules."""
CHANGE_GOAL = 0.02
"""nftables: seconds a one-service change may take."""
SIZE_GROWTH_GOAL = 1.5
"""nftables: a partial sync at the largest N costs at most this many at the smallest."""
CONNECTION_GOAL = 0.8
"""nftables: connections/s through a ClusterIP at the largest N, as a share of direct through
a node without rules."""
CHURN_CHANGES = 1000
CHURN_SERVICES = 100
PROGRAMMING_METRIC = "network programming metric"
CLUSTER_IP_RULE = re.compile(r'^-A KNIT-SERVICES .*--comment "default/([^:]+): cluster IP"')
T = TypeVar("T")
Saved = dict[int, str]
"""The rules the daemon wrote, per family, as its mode's tool lists them."""
Load = tuple[int, str]
"""One transaction of a bare load, and its family."""
SERVER = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])), backlog=4096)
print("ready", flush=True)
while True:
    server.accept()[0].close()
"""
CLIENT_LOOP = """
import socket, struct, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
reset = struct.pack("ii", 1, 0)
count, end = 0, time.monotonic() + seconds
while time.monotonic() < end:
    with socket.socket() as sock:
        sock.settimeout(2)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, reset)
        sock.connect((host, port))
    count += 1
print(count / seconds)
"""


def timed(fn: Callable[[], Any]) -> float:
    began = time.monotonic()
    fn()
    return time.monotonic() - began


def in_netns(ns: Netns, fn: Callable[[], T]) -> T:
    """fn() run by a worker thread that entered ns (what it starts is in ns too); the calling
    thread stays where it is."""

    def entered_call() -> T:
        with ns.entered():
            return fn()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(entered_call).result()


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def secs(seconds: float) -> str:
    return f"{seconds:.2f} s"


def service_name(index: int) -> str:
    return f"svc-{index:05d}"


def fake_endpoints(index: int) -> list[dict[str, Any]]:
    """Pod IPs in 10.244.0.0-10.244.99.255, away from the client and the backend."""
    hosts = ((index * ENDPOINTS + j) % 25000 for j in range(ENDPOINTS))
    return [endpoint(f"10.244.{h // 250}.{h % 250 + 1}", REMOTE_NODE) for h in hosts]


def api_client(plane: ControlPlane) -> client.ApiClient:
    configuration = client.Configuration()
    config.load_kube_config(str(plane.kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = WORKERS
    return client.ApiClient(configuration)


def create_services(kube: Kube, indices: range) -> float:
    """Seconds to create a Service and its EndpointSlice for each index, in parallel."""

    def one(index: int) -> None:
        name = service_name(index)
        ports = [{"port": PORT, "targetPort": TARGET_PORT, "protocol": "TCP"}]
        kube.call("POST", SERVICES, service_object(name, ports))
        kube.call("POST", SLICES, slice_object(name, fake_endpoints(index), SLICE_PORTS))

    began = time.monotonic()
    pool = ThreadPoolExecutor(WORKERS)
    try:
        list(pool.map(one, indices))
    finally:
        pool.shutdown(cancel_futures=True)
    return time.monotonic() - began


def make_netns(prefix: str, stack: ExitStack) -> Netns:
    """A fresh network namespace (lo up), removed when stack closes."""
    return stack.enter_context(namespaces("kpb-"))(prefix)


class Mode(ABC):
    """What differs between the modes knit-proxyd is measured in: how its rules are read
    back, written bare, looked up and changed."""

    name: str
    loader: str
    """The bare load, as the figures name it."""
    judged = False
    """The issue's goals are this mode's."""

    @abstractmethod
    def prepare(self, node: Netns) -> None:
        """Make the node look as this mode expects, before the daemon starts."""

    @abstractmethod
    def save(self, ns: Netns) -> Saved:
        """The rules the daemon wrote, in both families (its full sync writes both)."""

    @abstractmethod
    def scripts(self, saved: Saved, fresh: bool) -> list[Load]:
        """The transactions writing `saved` as a full sync of the daemon does: into a fresh
        namespace, or (not fresh) over the same rules."""

    @abstractmethod
    def write(self, family: int, text: str) -> None:
        """One transaction of the family, in the calling thread's namespace."""

    def load(self, ns: Netns, scripts: list[Load]) -> float:
        """Seconds to write the transactions into ns, from a thread inside it."""

        def write_all() -> None:
            for family, script in scripts:
                self.write(family, script)

        return in_netns(ns, lambda: timed(write_all))

    @abstractmethod
    def endpoints(self, ns: Netns, name: str, cluster_ip: str) -> str:
        """The endpoints the kernel holds for the service `name`, as listed."""

    @abstractmethod
    def change(self, ctx: FamilyContext, before: PortPlan, after: PortPlan) -> str:
        """The daemon's partial load taking one service port from `before` to `after`."""

    @abstractmethod
    def summary(self, saved: Saved) -> str:
        """How much the daemon wrote."""

    @abstractmethod
    def connection_target(self, saved: Saved, size: int) -> str:
        """The service to connect through."""

    @abstractmethod
    def dispatch(self, node: Netns, target: str) -> str:
        """How a new connection finds the target's rules."""


class Iptables(Mode):
    """One flavour of the IPv4 iptables binaries, run in namespaces."""

    name = "iptables"

    def __init__(self, flavour: str) -> None:
        self.flavour = flavour
        self.kernels = {family: IptablesKernel(family, flavour) for family in IP_FAMILIES}
        self.loader = f"{self.kernels[4].restore_binary} --noflush"

    def prepare(self, node: Netns) -> None:
        if self.flavour == "legacy":
            node.run(self.kernels[4].binary, "-t", "mangle", "-N", LEGACY_HINT)
        detected = in_netns(node, detect_iptables_flavour)
        assert detected == self.flavour, f"the node detects {detected}"

    def save(self, ns: Netns) -> Saved:
        def saved() -> Saved:
            return {f: k.save("nat") + k.save("filter") for f, k in self.kernels.items()}

        return in_netns(ns, saved)

    def scripts(self, saved: Saved, fresh: bool) -> list[Load]:
        """Per family, every chain rewritten (on nft, NFT_CHAINS_PER_RESTORE chains per
        restore, each after the chains it jumps to), the jumps from built-in chains added when
        fresh."""
        scripts = []
        for family, rules_saved in saved.items():
            chains, hooks = saved_chains(rules_saved)
            per_script = NFT_CHAINS_PER_RESTORE if self.flavour == "nft" else len(chains)
            batches = []
            for first in range(0, len(chains), per_script):
                batch = Script()
                for table, chain, rules in chains[first : first + per_script]:
                    batch.rewrite(table, chain, rules)
                batches.append(batch)
            if fresh:
                for table, chain, rule in reversed(hooks):
                    batches[-1].insert(table, chain, rule)
            scripts += [(family, batch.text()) for batch in batches]
        return scripts

    def write(self, family: int, text: str) -> None:
        self.kernels[family].restore(text)

    def endpoints(self, ns: Netns, name: str, cluster_ip: str) -> str:
        chain = ServiceChains(ServicePortName("default", name, "", "TCP")).cluster
        return ns.run(self.kernels[4].binary, "-w", "5", "-t", "nat", "-S", chain).stdout

    def change(self, ctx: FamilyContext, before: PortPlan, after: PortPlan) -> str:
        def rules(plan: PortPlan) -> RuleSet:
            rendered = iptables_render.render_service(plan, ctx)
            return RuleSet(iptables_render.render_base(ctx), {plan.port.name: rendered})

        return partial_script(rules(before), rules(after), [after.port.name]).text()

    def summary(self, saved: Saved) -> str:
        lines = [line for family in IP_FAMILIES for line in saved[family].splitlines()]
        rules = sum(1 for line in lines if line.startswith("-A "))
        chains = sum(1 for line in lines if line.startswith(":"))
        return f"{rules} rules in {chains} chains (nat + filter, IPv4 + IPv6)"

    def connection_target(self, saved: Saved, size: int) -> str:
        order = service_order(saved[4])
        print(
            f"  KNIT-SERVICES holds {len(order)} cluster IP rules, in name order: "
            f"{'yes' if order == sorted(order) else 'no'}; the last is {order[-1]}'s"
        )
        return order[-1]

    def dispatch(self, node: Netns, target: str) -> str:
        order = service_order(self.save(node)[4])
        return f"rule {order.index(target) + 1} of {len(order)}"


def saved_chains(
    saved: str,
) -> tuple[list[tuple[str, str, tuple[str, ...]]], list[tuple[str, str, str]]]:
    """iptables-save output as ([(table, chain, rules)] of the chains that are not built in,
    each after the chains it jumps to, a service's chains together as the daemon batches them;
    [(table, built-in chain, rule)])."""
    rules: dict[tuple[str, str], list[str]] = {}
    hooks = []
    table = ""
    for line in saved.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":") and (name := line[1:].split(" ", 1)[0]) not in BUILTIN_CHAINS:
            rules[(table, name)] = []
        elif line.startswith("-A "):
            _, name, rule = line.split(" ", 2)
            if name in BUILTIN_CHAINS:
                hooks.append((table, name, rule))
            else:
                rules[(table, name)].append(rule)
    jumps = {
        key: [
            target
            for rule in chain
            if (m := JUMP.search(rule)) and (target := (key[0], m[1])) in rules
        ]
        for key, chain in rules.items()
    }
    jumped_to = {target for chain_jumps in jumps.values() for target in chain_jumps}
    ordered: dict[tuple[str, str], None] = {}

    def visit(key: tuple[str, str]) -> None:
        if key not in ordered:
            for target in jumps[key]:
                visit(target)
            ordered[key] = None

    for key in sorted(rules, key=lambda key: key in jumped_to):  # from the chains none jumps to
        visit(key)
    return [(table, name, tuple(rules[(table, name)])) for table, name in ordered], hooks


class Nftables(Mode):
    """The daemon's table `ip knit`, read and loaded with nft in namespaces."""

    name = "nftables"
    loader = "nft -f"
    judged = True

    def __init__(self) -> None:
        self.kernels = {family: Nft(family) for family in IP_FAMILIES}
        self.saved_generation = 0
        """The generation of maps the last listing saved holds (the anchor's, once loaded)."""

    def prepare(self, node: Netns) -> None:
        """Nothing: the mode does not depend on the node's iptables."""

    def save(self, ns: Netns) -> Saved:
        saved = {
            family: ns.run("nft", "list", "table", *kernel.table.split(), timeout=600).stdout
            for family, kernel in self.kernels.items()
        }
        # Between full syncs the table holds one generation (both only after a refused one,
        # which fails the bench anyway).
        newer = f"map {nftables_render.SERVICE_IPS}{GENERATION_SUFFIXES[1]} {{"
        self.saved_generation = 1 if newer in saved[4] else 0
        return saved

    def scripts(self, saved: Saved, fresh: bool) -> list[Load]:
        """Both tables in one transaction (nft writes any family's)."""
        tables = "".join(saved.values())
        deleted = "".join(f"delete table {kernel.table}\n" for kernel in self.kernels.values())
        return [(4, tables if fresh else deleted + tables)]

    def write(self, family: int, text: str) -> None:
        """A bare `nft -f` process (the daemon runs libnftables in its own process)."""
        subprocess.run(["nft", "-f", "-"], input=text, text=True, capture_output=True, check=True)

    def endpoints(self, ns: Netns, name: str, cluster_ip: str) -> str:
        """The elements of the endpoint map keyed by the service's cluster IP, in whichever
        generation the table holds (without the map's name, which tells the generation)."""
        keys = ", ".join(f"{cluster_ip} . {PORT} . {index}" for index in range(ENDPOINTS))
        endpoint_map = nftables_render.IPS.endpoint_map(local=False, proto="tcp")
        table = self.kernels[4].table.split()
        maps = ns.run("nft", "--terse", "list", "maps", table[0]).stdout
        for suffix in GENERATION_SUFFIXES:
            if f"map {endpoint_map}{suffix} {{" not in maps:
                continue
            got = ns.run(
                "nft",
                "get",
                "element",
                *table,
                f"{endpoint_map}{suffix}",
                f"{{ {keys} }}",
                check=False,
            )
            if got.returncode == 0:
                return got.stdout.split("elements = ", 1)[-1]
        raise RuntimeError(f"no endpoint map holds {name}'s endpoints in {ns.name}")

    def change(self, ctx: FamilyContext, before: PortPlan, after: PortPlan) -> str:
        """The change as the daemon writes it, in the generation of the anchor's table."""
        name = after.port.name
        port_ctx = nftables_render.PortContext.of(ctx)
        table = TableState(nftables_render.render_base(ctx), generation=self.saved_generation)
        before_objects = nftables_render.render_service(before, port_ctx)
        partial_transaction(ctx.family, table, {name: before_objects})  # as the daemon wrote it
        return partial_transaction(
            ctx.family, table, {name: nftables_render.render_service(after, port_ctx)}
        )

    def summary(self, saved: Saved) -> str:
        return ", ".join(
            f"{len(CHAIN_LINE.findall(saved[family]))} chains in table {kernel.table}"
            for family, kernel in self.kernels.items()
        )

    def connection_target(self, saved: Saved, size: int) -> str:
        return service_name(size - 1)

    def dispatch(self, node: Netns, target: str) -> str:
        return "a verdict-map lookup, then an endpoint-map lookup"


def service_order(saved: str) -> list[str]:
    """Service names in the order of their cluster IP rules in KNIT-SERVICES."""
    return [m.group(1) for line in saved.splitlines() if (m := CLUSTER_IP_RULE.match(line))]


class SliceChange:
    """One service's EndpointSlice, changed in the API one endpoint at a time."""

    def __init__(self, kube: Kube, name: str) -> None:
        self.kube = kube
        self.name = name
        self.endpoints = kube.call("GET", f"{SLICES}/{name}-ipv4")["endpoints"]
        self.changes = 0

    def apply(self, new_ip: str) -> None:
        """Replace the endpoint changed longest ago by new_ip, stamping the slice with the time
        of the change as the EndpointSlice controller stamps its own."""
        self.endpoints[self.changes % len(self.endpoints)] = endpoint(new_ip, REMOTE_NODE)
        self.changes += 1
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        patch = {"metadata": {"annotations": {TRIGGER_TIME: stamp}}, "endpoints": self.endpoints}
        self.kube.patch(f"{SLICES}/{self.name}-ipv4", patch)


class OneServiceChange:
    """Replaces one endpoint of one service's slice at a time: in the API, and (rendered by the
    daemon's code, in the context the daemon's proxier builds for the node) as the mode's
    partial load of the same change."""

    def __init__(
        self, kube: Kube, mode: Mode, daemon: Daemon, index: int, fresh: Iterator[str]
    ) -> None:
        self.mode = mode
        self.fresh = fresh
        self.slice = SliceChange(kube, service_name(index))
        self.name = self.slice.name
        spec = kube.call("GET", f"{SERVICES}/{self.name}")["spec"]
        self.cluster_ip = spec["clusterIP"]
        port_name = ServicePortName("default", self.name, "", "TCP")
        self.port = ServicePort(port_name, (self.cluster_ip,), PORT)
        node = parse_node(kube.call("GET", f"/api/v1/nodes/{NODE}"))
        settings = load_config(daemon.args)
        self.ctx = in_netns(  # the iptables proxier detects the flavour where it is made
            daemon.ns, lambda: make_proxier(mode.name, settings, Metrics()).context(4, node)
        )

    def _plan(self, endpoints: list[dict[str, Any]]) -> PortPlan:
        ordered = sorted(
            (Endpoint(e["addresses"][0], TARGET_PORT, node_name=REMOTE_NODE) for e in endpoints),
            key=lambda e: e.ip,
        )
        plan = plan_port(self.port, tuple(ordered), self.ctx)
        assert plan is not None
        return plan

    def listed(self, ns: Netns) -> str:
        """The service's endpoints as ns's kernel holds them."""
        return self.mode.endpoints(ns, self.name, self.cluster_ip)

    def apply(self) -> tuple[str, str]:
        """Patch the slice; return (the new endpoint's address, the change)."""
        before = self._plan(self.slice.endpoints)
        new_ip = next(self.fresh)
        self.slice.apply(new_ip)
        return new_ip, self.mode.change(self.ctx, before, self._plan(self.slice.endpoints))


def one_lookup_dnat(address: str) -> str:
    """A table DNATing new connections to address:PORT to one of the target's endpoints, at
    random, through one verdict-map lookup: the least a NAT datapath does."""
    endpoints = ", ".join(f"{index} : {ip}" for index, ip in enumerate(BACKENDS[:ENDPOINTS]))
    return f"""table ip one-lookup {{
  map services {{
    type ipv4_addr . inet_proto . inet_service : verdict
    elements = {{ {address} . tcp . {PORT} : goto endpoints }}
  }}
  chain endpoints {{
    meta l4proto tcp dnat to numgen random mod {ENDPOINTS} map {{ {endpoints} }} : {TARGET_PORT}
  }}
  chain prerouting {{
    type nat hook prerouting priority dstnat
    ip daddr . meta l4proto . th dport vmap @services
  }}
}}
"""


def veth(node: Netns, name: str, pod: Netns, gateway: str, addresses: list[str]) -> None:
    """A veth from the node (NAME, holding the gateway) to the pod (eth0, the addresses)."""
    node.run("ip", "link", "add", name, "type", "veth", "peer", "name", "eth0", "netns", pod.name)
    node.run("ip", "addr", "add", f"{gateway}/24", "dev", name)
    node.run("ip", "link", "set", name, "up")
    for address in addresses:
        pod.run("ip", "addr", "add", f"{address}/24", "dev", "eth0")
    pod.run("ip", "link", "set", "eth0", "up")
    pod.run("ip", "route", "add", "default", "via", gateway)


@dataclass(frozen=True)
class Row:
    mode: str
    size: int
    figure: str
    knit: str
    anchor: str = ""
    ratio: str = ""
    goal: str = ""


def columns(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """Rows as a table of left-aligned columns under a header."""
    cells = [header, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


@dataclass
class Report:
    """Figures as measured: printed at once, and as tables at the end."""

    rows: list[Row] = field(default_factory=list)

    def add(self, row: Row) -> None:
        self.rows.append(row)
        extra = "".join(
            f" | {label} {value}"
            for label, value in (("anchor", row.anchor), ("ratio", row.ratio), ("goal", row.goal))
            if value
        )
        print(f"  {row.figure}: {row.knit}{extra}", flush=True)

    def table(self) -> str:
        header = ("mode", "N", "figure", "knit-proxyd", "anchor", "ratio", "goal")
        return columns(
            header,
            [(r.mode, str(r.size), r.figure, r.knit, r.anchor, r.ratio, r.goal) for r in self.rows],
        )

    def comparison(self, modes: list[str]) -> str:
        """One line per N and figure: each mode's figure with its ratio to its anchor, and
        the judged mode's goal."""
        cells: dict[tuple[int, str], dict[str, Row]] = {}
        for row in self.rows:
            if row.mode in modes:
                cells.setdefault((row.size, row.figure), {})[row.mode] = row
        lines = []
        for (size, figure), by_mode in sorted(cells.items(), key=lambda item: item[0][0]):
            values = (cell(by_mode.get(mode)) for mode in modes)
            goal = next((r.goal for r in by_mode.values() if r.goal), "")
            lines.append((str(size), figure, *values, goal))
        return columns(("N", "figure", *modes, "goal (nftables)"), lines)


def paired(rates: dict[str, list[float]], kind: str, anchor: str) -> float:
    """The median of the rounds' own ratios of kind's rate to anchor's."""
    return statistics.median(a / b for a, b in zip(rates[kind], rates[anchor], strict=True))


def cell(row: Row | None) -> str:
    if row is None:
        return ""
    return f"{row.knit} ({row.ratio})" if row.ratio else row.knit


def ratio(value: float, anchor: float) -> str:
    return times(value / anchor)


def times(factor: float) -> str:
    return f"{factor:.2f}x"


def mib(value: float) -> str:
    return f"{value:.0f} MiB"


@dataclass(frozen=True)
class Figure:
    """A figure taken of knit-proxyd and of kube-proxy alike, to be set side by side."""

    name: str
    unit: Callable[[float], str]
    higher_is_better: bool = False
    goal: float = 1.0
    """knit's figure against kube-proxy's, judged in the nftables mode at the largest N."""


COLD = Figure("cold start to the first full sync done (wall)", secs)
FIRST = Figure("first full sync (metric)", secs)
STEADY = Figure("full sync at steady state (metric, median)", secs)
PARTIAL_SYNC = Figure("one-service change: partial sync (metric, median)", ms, goal=0.1)
PROGRAMMED = Figure(
    "one-service change: API to rules in kernel (network programming metric, median)",
    ms,
    goal=0.1,
)
CONNECTIONS = Figure(
    "TCP connections/s via ClusterIP, as a share of direct through a node without rules",
    times,
    higher_is_better=True,
)
RSS_START = Figure("memory after start (VmRSS)", mib)
RSS_PEAK = Figure("memory peak (VmHWM)", mib)
CHURN = Figure(f"CPU time over a churn of {CHURN_CHANGES:,} endpoint changes", secs)
BESIDE = (COLD, FIRST, STEADY, PARTIAL_SYNC, PROGRAMMED, CONNECTIONS, RSS_START, RSS_PEAK, CHURN)


class Bench:
    def __init__(
        self, options: argparse.Namespace, plane: ControlPlane, kube: Kube, work: Path
    ) -> None:
        self.options = options
        self.plane = plane
        self.kube = kube
        self.work = work
        self.report = Report()
        self.repeats = 1 if options.quick else 3
        self.fresh = (f"10.244.150.{host}" for host in itertools.count(1))
        """Addresses no endpoint had, for one-service changes."""
        self.partial: dict[str, dict[int, tuple[float, float]]] = {}
        """mode -> N -> (median partial sync, median bare load) of one-service changes."""
        self.churn_addresses = (
            f"10.244.{100 + n // 250 % 50}.{n % 250 + 1}" for n in itertools.count()
        )
        """Endpoint addresses for the churns, in 10.244.100.0-10.244.149.255 (reused after
        12,500: an address comes back long after it was replaced)."""
        self.beside: dict[tuple[str, int], dict[Figure, dict[str, float]]] = {}
        """(mode, N) -> figure -> program -> value."""
        self.targets: dict[str, str] = {}
        """mode -> the service knit-proxyd's connections went through."""

    def add(
        self,
        mode: Mode,
        size: int,
        figure: str,
        knit: str,
        anchor: str = "",
        ratio: str = "",
        goal: tuple[str, bool] | None = None,
    ) -> None:
        """Report a figure; `goal` (its text, whether it is met) counts in a judged mode."""
        judged = f"{goal[0]}: {'met' if goal[1] else 'NOT met'}" if goal and mode.judged else ""
        self.report.add(Row(mode.name, size, figure, knit, anchor, ratio, judged))

    def size(self, size: int, mode: Mode, largest: bool) -> None:
        heading = f"{size} services, knit-proxyd in {mode.name} mode (anchors: bare {mode.loader})"
        print(f"\n{heading}:", flush=True)
        tag = f"{mode.name}-{size}"
        profile = self.work / f"proxyd-{tag}.prof" if self.options.profile else None
        with ExitStack() as stack:
            node, kubeconfig, folder = self.node(tag, mode, stack)
            (folder / "networks").mkdir()
            files = NodeFiles(folder / "net.d", folder / "bin", folder / "networks")
            args = proxyd_flags(
                kubeconfig,
                NODE,
                CLUSTER_CIDR,
                files,
                "--metrics-bind-address",
                METRICS_ADDRESS,
                mode=mode.name,
            )
            daemon = Daemon.knit(node, args, self.work / f"proxyd-{tag}.log", profile)
            stack.callback(daemon.stop)
            self.measure(size, mode, largest, daemon, stack)
        if profile is not None:
            print(f"  the daemon's main thread, under cProfile ({profile}):")
            pstats.Stats(str(profile)).sort_stats("cumulative").print_stats("proxyd/", 25)
        print(f"\n{size} services, kube-proxy in {mode.name} mode, the same figures:", flush=True)
        with ExitStack() as stack:
            node, kubeconfig, folder = self.node(f"kube-proxy-{tag}", mode, stack)
            peer = Daemon.kube_proxy(node, kubeconfig, NODE, CLUSTER_CIDR, mode.name, folder)
            stack.callback(peer.stop)
            self.measure_peer(size, mode, largest, peer, stack)

    def node(self, tag: str, mode: Mode, stack: ExitStack) -> tuple[Netns, Path, Path]:
        """A fresh node namespace as the mode expects it, a kubeconfig for a daemon inside it,
        and a folder for its files; removed when stack closes."""
        node = make_netns("node", stack)
        mode.prepare(node)
        forward = NetnsForward(node.name, self.plane.port)
        stack.callback(forward.stop)
        kubeconfig = self.plane.write_kubeconfig(
            self.work / f"kubeconfig-{tag}", forward.listen_port
        )
        folder = self.work / tag
        folder.mkdir(parents=True)
        return node, kubeconfig, folder

    def measure_peer(
        self, size: int, mode: Mode, largest: bool, daemon: Daemon, stack: ExitStack
    ) -> None:
        """kube-proxy's figures that knit-proxyd's are set beside, taken the same way."""
        try:
            synced = daemon.wait_sync(FULL, 0, self.options.sync_timeout)
        except TimeoutError:
            knit = self.beside.get((mode.name, size), {}).get(FIRST, {}).get(KNIT)
            figure = f"beside kube-proxy: {FIRST.name}"
            limit = f"kube-proxy not done within {self.options.sync_timeout:.0f} s"
            self.report.add(Row(mode.name, size, figure, secs(knit) if knit else "", limit))
            return
        first = spent(synced, {}, FULL)
        self.note(mode, size, COLD, KUBE_PROXY, synced[LAST_SYNC] - daemon.started)
        self.note(mode, size, FIRST, KUBE_PROXY, first)
        self.note(mode, size, RSS_START, KUBE_PROXY, daemon.memory_mib()[0])
        if first < FORCED_FULL_LIMIT:
            forced = [self.force_full_sync(size, mode, daemon, n) for n in range(self.repeats)]
            done = [sync for sync in forced if sync is not None]
            if len(done) == len(forced):
                self.note(mode, size, STEADY, KUBE_PROXY, statistics.median(done))
        change = SliceChange(self.kube, service_name(size // 2))
        syncs, latencies = [], []
        for _ in range(5 if self.options.quick else 10):
            time.sleep(1.0)  # kube-proxy's default minSyncPeriod, since the last sync
            before, since = daemon.metrics(), daemon.log_size()
            change.apply(next(self.fresh))
            after = daemon.wait_sync(PARTIAL, since, 60, change=before)
            syncs.append(spent(after, before, PARTIAL))
            latencies.append(programming(after, before))
        self.note(mode, size, PARTIAL_SYNC, KUBE_PROXY, statistics.median(syncs))
        self.note(mode, size, PROGRAMMED, KUBE_PROXY, statistics.median(latencies))
        # before the churn, which may change the target's endpoints
        if largest and (target := self.targets.get(mode.name)):
            client_ns = self.attach(daemon.ns, stack)
            plain_client = self.attach(make_netns("plain", stack), stack)
            cluster_ip = self.kube.call("GET", f"{SERVICES}/{target}")["spec"]["clusterIP"]
            rates = self.rounds(
                {
                    "service": (client_ns, cluster_ip, PORT),
                    "plain": (plain_client, BACKENDS[-1], TARGET_PORT),
                }
            )
            self.note(mode, size, CONNECTIONS, KUBE_PROXY, paired(rates, "service", "plain"))
        self.note(mode, size, CHURN, KUBE_PROXY, self.churn(daemon))
        self.note(mode, size, RSS_PEAK, KUBE_PROXY, daemon.memory_mib()[1])

    def keep(self, mode: Mode, size: int, figure: Figure, program: str, value: float) -> None:
        """A figure of one program, for the comparison of the two."""
        self.beside.setdefault((mode.name, size), {}).setdefault(figure, {})[program] = value

    def note(self, mode: Mode, size: int, figure: Figure, program: str, value: float) -> None:
        """A figure kept for the comparison that no row of the report shows: printed at once."""
        self.keep(mode, size, figure, program, value)
        print(f"  {figure.name}: {figure.unit(value)}", flush=True)

    def churn(self, daemon: Daemon) -> float:
        """CPU seconds the daemon spends on CHURN_CHANGES endpoint changes, made one after the
        other as fast as the API takes them, each replacing one endpoint of one of the first
        CHURN_SERVICES services, until it has programmed them all (no change pending, a sync
        ended after the last)."""
        slices = [SliceChange(self.kube, service_name(index)) for index in range(CHURN_SERVICES)]
        began = daemon.cpu_seconds()
        for change in range(CHURN_CHANGES):
            slices[change % CHURN_SERVICES].apply(next(self.churn_addresses))
        patched = time.time()
        time.sleep(0.5)  # the last events reach the daemon's watch

        def programmed() -> bool:
            metrics = daemon.metrics()
            return metrics.get(PENDING, 0.0) == 0 and metrics[LAST_SYNC] > patched

        eventually(programmed, 300, f"{daemon.program}: the churn programmed", 0.5)
        return daemon.cpu_seconds() - began

    def measure(
        self, size: int, mode: Mode, largest: bool, daemon: Daemon, stack: ExitStack
    ) -> None:
        try:
            synced = daemon.wait_sync(FULL, 0, self.options.sync_timeout)
        except TimeoutError:
            limit = f"> {self.options.sync_timeout:.0f} s"
            self.add(mode, size, "full sync at start (metric)", f"not done, {limit}")
            return
        if (count := synced[f"{FULL}_count"]) != 1:
            raise RuntimeError(f"{count:.0f} full syncs at start, not one")
        full = spent(synced, {}, FULL)
        rss, _ = daemon.memory_mib()
        self.add(mode, size, "daemon memory after start (VmRSS)", f"{rss:.0f} MiB")
        saved = mode.save(daemon.ns)
        wall = synced[LAST_SYNC] - daemon.started
        for figure, value in ((COLD, wall), (FIRST, full), (RSS_START, rss)):
            self.keep(mode, size, figure, KNIT, value)
        anchor = self.bare_loads(size, mode, saved, full, wall, stack)
        if full < FORCED_FULL_LIMIT:
            self.forced_full_syncs(size, mode, daemon, anchor, saved)
        else:
            print(f"  no forced full sync: the first took {secs(full)}")
        self.one_service_changes(size, mode, daemon, anchor)
        self.note(mode, size, CHURN, KNIT, self.churn(daemon))
        if largest:
            self.connection_rate(size, mode, daemon, saved, stack)
        rss, hwm = daemon.memory_mib()
        self.add(mode, size, "daemon memory at the end (VmRSS/peak)", f"{rss:.0f}/{hwm:.0f} MiB")
        self.keep(mode, size, RSS_PEAK, KNIT, hwm)

    def bare_loads(
        self, size: int, mode: Mode, saved: Saved, full: float, wall: float, stack: ExitStack
    ) -> Netns:
        """Time loading `saved` into fresh namespaces; return the last one, left loaded until
        stack closes."""
        scripts = mode.scripts(saved, fresh=True)
        times = []
        for repeat in range(self.repeats):
            with ExitStack() as attempt:
                ns = make_netns("anchor", attempt)
                times.append(mode.load(ns, scripts))
                if repeat == self.repeats - 1:
                    stack.enter_context(attempt.pop_all())
        bare = statistics.median(times)
        what = f"bare {mode.loader} {secs(bare)} (transactions: {len(scripts)})"
        print(f"  the daemon wrote {mode.summary(saved)}")
        goal = (f"<= {FULL_SYNC_GOAL}x", full / bare <= FULL_SYNC_GOAL)
        figure = "full sync at start (metric)"
        self.add(mode, size, figure, secs(full), what, ratio(full, bare), goal)
        self.add(mode, size, "start to rules in kernel (wall)", secs(wall))
        self.add(mode, size, "start-up before the full sync (wall - metric)", secs(wall - full))
        return ns

    def forced_full_syncs(
        self, size: int, mode: Mode, daemon: Daemon, anchor: Netns, saved: Saved
    ) -> None:
        scripts = mode.scripts(saved, fresh=False)
        figure = "full sync at steady state (metric, median)"
        forced, bares = [], []
        for repeat in range(self.repeats):
            if (forced_sync := self.force_full_sync(size, mode, daemon, repeat)) is None:
                self.add(mode, size, figure, f"not done, > {self.options.sync_timeout:.0f} s")
                return
            forced.append(forced_sync)
            bares.append(mode.load(anchor, scripts))
        sync, bare = statistics.median(forced), statistics.median(bares)
        self.keep(mode, size, STEADY, KNIT, sync)
        what = f"bare {mode.loader} over the same rules {secs(bare)}"
        goal = (f"<= {FULL_SYNC_GOAL}x", sync / bare <= FULL_SYNC_GOAL)
        self.add(mode, size, figure, secs(sync), what, ratio(sync, bare), goal)

    def force_full_sync(self, size: int, mode: Mode, daemon: Daemon, repeat: int) -> float | None:
        """Seconds of one full sync (the daemon's metric) forced by a change of the Node's
        zone; None when it did not end within --sync-timeout."""
        before, since = daemon.metrics(), daemon.log_size()
        zone = f"zone-{size}-{mode.name}-{daemon.program}-{repeat}"
        self.kube.patch(f"/api/v1/nodes/{NODE}", {"metadata": {"labels": {ZONE_LABEL: zone}}})
        try:
            after = daemon.wait_sync(FULL, since, self.options.sync_timeout)
        except TimeoutError:
            return None
        if after[f"{FULL}_count"] != before[f"{FULL}_count"] + 1:
            raise RuntimeError("more than one full sync after one change of the Node")
        return spent(after, before, FULL)

    def one_service_changes(self, size: int, mode: Mode, daemon: Daemon, anchor: Netns) -> None:
        """Changes measured by metrics and the daemon's timestamp; then, when a look at the
        kernel is cheap, as many changes polled from outside (not mixed: polling costs)."""
        node = daemon.ns
        change = OneServiceChange(self.kube, mode, daemon, size // 2, self.fresh)

        def programmed(target: str) -> bool:
            return target in change.listed(node)

        def one(polled: bool) -> None:
            """One change, its figures added to latencies, or (not polled) syncs and bares."""
            time.sleep(1.0)  # the daemon's default --min-sync-period, since the last sync
            before, since = daemon.metrics(), daemon.log_size()
            target, script = change.apply()
            patched, patched_at = time.monotonic(), time.time()
            if polled:
                eventually(
                    lambda: programmed(target),
                    60,
                    f"{target} among {change.name}'s endpoints",
                    interval=0.005,
                )
                latencies["polled from outside"].append(time.monotonic() - patched)
            after = daemon.wait_sync(PARTIAL, since, 60, change=before)
            assert programmed(target), f"{target} was not programmed"
            bare = mode.load(anchor, [(4, script)])
            assert change.listed(anchor) == change.listed(node), (
                f"the bare change left {change.name}'s endpoints unlike the daemon's"
            )
            if not polled:
                latencies["daemon's timestamp"].append(after[LAST_SYNC] - patched_at)
                latencies[PROGRAMMING_METRIC].append(programming(after, before))
                syncs.append(spent(after, before, PARTIAL))
                bares.append(bare)

        poll_cost = timed(lambda: programmed(""))
        outside = poll_cost < OUTSIDE_POLL_LIMIT
        syncs: list[float] = []
        bares: list[float] = []
        latencies: dict[str, list[float]] = {
            "daemon's timestamp": [],
            PROGRAMMING_METRIC: [],
            "polled from outside": [],
        }
        changes = 5 if self.options.quick else 10
        for polled in [False] * changes + [True] * (changes if outside else 0):
            one(polled)
        self.partial.setdefault(mode.name, {})[size] = (
            statistics.median(syncs),
            statistics.median(bares),
        )
        goal = f"< {ms(CHANGE_GOAL)}"
        for label, values in (("median", statistics.median), ("max", max)):
            sync, bare = values(syncs), values(bares)
            self.add(
                mode,
                size,
                f"one-service change: partial sync ({label}, metric)",
                ms(sync),
                f"bare {mode.loader} of the change ({label}) {ms(bare)}",
                ratio(sync, bare),
                (goal, sync < CHANGE_GOAL) if label == "median" else None,
            )
        for how, samples in latencies.items():
            for label, values in (("median", statistics.median), ("max", max)):
                if samples:
                    latency = values(samples)
                    self.add(
                        mode,
                        size,
                        f"one-service change: PATCH to rules in kernel ({label}, {how})",
                        ms(latency),
                        goal=(goal, latency < CHANGE_GOAL) if label == "median" else None,
                    )
        self.keep(mode, size, PARTIAL_SYNC, KNIT, statistics.median(syncs))
        self.keep(mode, size, PROGRAMMED, KNIT, statistics.median(latencies[PROGRAMMING_METRIC]))
        look = f"one look at {change.name}'s endpoints costs {ms(poll_cost)}"
        print(f"  ({look}{'' if outside else ', too much to poll without disturbing the daemon'})")

    def beside_kube_proxy(self, largest: int) -> None:
        """knit-proxyd's figures beside kube-proxy's, each a row of the report: the ratio is
        knit's to kube-proxy's, judged (in the nftables mode at the largest N) against the
        figure's goal: at or ahead of kube-proxy, a one-service change a tenth of its."""
        print("\nknit-proxyd beside kube-proxy:", flush=True)
        for (mode_name, size), figures in self.beside.items():
            for figure in BESIDE:
                values = figures.get(figure, {})
                if KNIT not in values or KUBE_PROXY not in values:
                    continue
                knit, peer = values[KNIT], values[KUBE_PROXY]
                factor = knit / peer
                met = factor >= figure.goal if figure.higher_is_better else factor <= figure.goal
                sign = ">=" if figure.higher_is_better else "<="
                goal = f"{sign} {figure.goal:g}x: {'met' if met else 'NOT met'}"
                judged = mode_name == "nftables" and size == largest
                self.report.add(
                    Row(
                        mode_name,
                        size,
                        f"beside kube-proxy: {figure.name}",
                        figure.unit(knit),
                        f"kube-proxy {figure.unit(peer)}",
                        times(factor),
                        goal if judged else "",
                    )
                )

    def size_growth(self, sizes: list[int], modes: list[Mode]) -> None:
        """The partial sync at the largest N against the smallest's, for each mode, beside the
        bare load's growth."""
        smallest, largest = sizes[0], sizes[-1]
        for mode in modes:
            medians = self.partial.get(mode.name, {})
            if smallest != largest and smallest in medians and largest in medians:
                (sync_small, bare_small), (sync_large, bare_large) = (
                    medians[smallest],
                    medians[largest],
                )
                growth = sync_large / sync_small
                self.add(
                    mode,
                    largest,
                    f"one-service change: growth of the median from N={smallest}",
                    f"{ratio(sync_large, sync_small)} ({ms(sync_small)} to {ms(sync_large)})",
                    f"bare {mode.loader} {ratio(bare_large, bare_small)} "
                    f"({ms(bare_small)} to {ms(bare_large)})",
                    goal=(f"<= {SIZE_GROWTH_GOAL}x", growth <= SIZE_GROWTH_GOAL),
                )

    def connection_rate(
        self, size: int, mode: Mode, daemon: Daemon, saved: Saved, stack: ExitStack
    ) -> None:
        node = daemon.ns
        target = mode.connection_target(saved, size)
        client_ns = self.attach(node, stack)
        plain_client = self.attach(make_netns("plain", stack), stack)
        slice_endpoints = [endpoint(ip, REMOTE_NODE) for ip in BACKENDS[:ENDPOINTS]]
        self.kube.patch(f"{SLICES}/{target}-ipv4", {"endpoints": slice_endpoints})
        cluster_ip = self.kube.call("GET", f"{SERVICES}/{target}")["spec"]["clusterIP"]
        eventually(
            lambda: BACKENDS[0] in mode.endpoints(node, target, cluster_ip),
            60,
            f"the backends among {target}'s endpoints",
            interval=0.05,
        )
        nat_node = make_netns("nat", stack)
        nat_node.run("nft", "-f", "-", stdin=one_lookup_dnat(cluster_ip))
        nat_client = self.attach(nat_node, stack)
        dispatch = mode.dispatch(node, target)
        self.targets[mode.name] = target
        rates = self.rounds(
            {
                "service": (client_ns, cluster_ip, PORT),
                "direct": (client_ns, BACKENDS[-1], TARGET_PORT),
                "plain": (plain_client, BACKENDS[-1], TARGET_PORT),
                "nat": (nat_client, cluster_ip, PORT),
            }
        )
        rate = {kind: statistics.median(values) for kind, values in rates.items()}
        spread = {
            kind: f"{min(values):.0f}/{rate[kind]:.0f}/{max(values):.0f}/s"
            for kind, values in rates.items()
        }
        seconds, repeats = self.load_time()
        how = f"min/median/max of {repeats} x {seconds:.0f} s"
        plain = f"direct, through a node without rules {spread['plain']}"
        direct = f"direct to the backend, through this node {spread['direct']}"
        share = paired(rates, "service", "plain")
        self.keep(mode, size, CONNECTIONS, KNIT, share)
        figure = f"TCP connections/s via ClusterIP ({how})"
        self.add(
            mode,
            size,
            figure,
            f"{spread['service']}, {dispatch}",
            plain,
            times(share),
            (f">= {CONNECTION_GOAL:.0%} of direct without rules", share >= CONNECTION_GOAL),
        )
        self.add(
            mode,
            size,
            f"{figure}, against direct through this node",
            spread["service"],
            direct,
            times(paired(rates, "service", "direct")),
        )
        self.add(
            mode,
            size,
            f"TCP connections/s direct to the backend, through this node ({how})",
            spread["direct"],
            plain,
            times(paired(rates, "direct", "plain")),
        )
        self.add(
            mode,
            size,
            f"{figure}, against one verdict-map DNAT through a node without other rules",
            spread["service"],
            f"one-lookup DNAT {spread['nat']}",
            times(paired(rates, "service", "nat")),
        )
        self.add(
            mode,
            size,
            f"TCP connections/s through one verdict-map DNAT and nothing else ({how})",
            f"one-lookup DNAT {spread['nat']}",
            plain,
            times(paired(rates, "nat", "plain")),
        )

    def load_time(self) -> tuple[float, int]:
        """(seconds of one connection load, rounds of loads)."""
        return (1.0, 2) if self.options.quick else (2.0, 7)

    def rounds(self, loads: dict[str, tuple[Netns, str, int]]) -> dict[str, list[float]]:
        """Connections/s of each load (a client namespace, host and port), the loads taking
        turns: a round is one run of each, back to back, each round starting one load further
        on."""
        seconds, repeats = self.load_time()
        rates: dict[str, list[float]] = {kind: [] for kind in loads}
        kinds = list(loads)
        for turn in range(repeats):
            for kind in kinds[turn % len(kinds) :] + kinds[: turn % len(kinds)]:
                ns, host, port = loads[kind]
                out = ns.run(sys.executable, "-c", CLIENT_LOOP, host, str(port), str(seconds))
                rates[kind].append(float(out.stdout))
        return rates

    def attach(self, node: Netns, stack: ExitStack) -> Netns:
        """A client and a backend (serving on all BACKENDS) routed through node, both removed
        when stack closes: the client."""
        client_ns, backend = make_netns("client", stack), make_netns("backend", stack)
        veth(node, "cl0", client_ns, CLIENT_GATEWAY, [CLIENT])
        veth(node, "be0", backend, BACKEND_GATEWAY, BACKENDS)
        node.run("sysctl", "-qw", "net.ipv4.ip_forward=1")
        server = subprocess.Popen(
            ["ip", "netns", "exec", backend.name, sys.executable, "-c", SERVER, str(TARGET_PORT)],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
        )
        backend.servers.append(server)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        return client_ns


MODES = ("iptables", "nftables")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000", help="numbers of services, e.g. 1000")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="proxy modes to measure, e.g. nftables"
    )
    parser.add_argument("--flavour", choices=("nft", "legacy"), default="nft")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter loads")
    parser.add_argument(
        "--sync-timeout", type=float, default=300.0, help="seconds allowed for a full sync"
    )
    parser.add_argument(
        "--profile", action="store_true", help="run the daemon under cProfile, print its top"
    )
    record.add_json_option(parser)
    options = parser.parse_args()
    sizes = sorted(int(size) for size in options.sizes.split(","))
    names = options.modes.split(",")
    if unknown := set(names) - set(MODES):
        parser.error(f"unknown modes {', '.join(sorted(unknown))} (one of {', '.join(MODES)})")
    available: dict[str, Mode] = {"iptables": Iptables(options.flavour), "nftables": Nftables()}
    modes = [available[name] for name in names]
    exit_on_termination()
    began_at = record.revision()
    print(f"at {began_at}", flush=True)
    with tempfile.TemporaryDirectory(prefix="knit-proxy-bench-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        plane = start(work / "controlplane")
        stack.callback(plane.stop)
        api = api_client(plane)
        stack.callback(api.close)
        kube = Kube(api)
        kube.call("POST", "/api/v1/nodes", node_object(NODE, [NODE_ADDRESS], zone="zone-a"))
        bench = Bench(options, plane, kube, work)
        created = 0
        for size in sizes:
            took = create_services(kube, range(created, size))
            objects = 2 * (size - created)
            print(f"\ncreated {objects} objects in {secs(took)} ({objects / took:.0f}/s)")
            figure = f"creating {objects} objects via the API"
            bench.report.add(Row("api", size, figure, secs(took)))
            created = size
            for mode in modes:
                bench.size(size, mode, size == sizes[-1])
        bench.size_growth(sizes, modes)
        bench.beside_kube_proxy(sizes[-1])
    print(f"\n{bench.report.table()}\n")
    print(f"{bench.report.comparison([mode.name for mode in modes])}\n")
    print(
        "connection goal: the ClusterIP's rate against direct through a node without rules; "
        "in the rows after it, against direct through the same node and against one "
        "verdict-map DNAT through a node without other rules, and that DNAT against direct "
        "through a node without rules (what any NAT costs here)"
    )
    print(f"command: {shlex.join(sys.orig_argv)} (at {began_at})")
    if (ended_at := record.revision()) != began_at:
        print(f"WARNING: the tree changed during the run: {began_at} at the start, {ended_at} now")
    path = record.result_path(options.json, "proxy", variant(options))
    record.write(path, [asdict(row) for row in bench.report.rows], began_at)
    chart.draw(path, path.with_suffix(".png"))


def variant(options: argparse.Namespace) -> str:
    """The part of the result file's name saying how the run differs from the default one."""
    parts = []
    if options.sizes != "1000,10000":
        parts.append("sizes-" + options.sizes.replace(",", "-"))
    if options.modes != ",".join(MODES):
        parts.append(options.modes.replace(",", "-"))
    if options.flavour != "nft":
        parts.append(options.flavour)
    if options.quick:
        parts.append("quick")
    return "-".join(parts)


if __name__ == "__main__":
    main()
