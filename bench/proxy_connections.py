"""TCP connections/s through a node's ClusterIP, against connections direct to the backend and
through one verdict-map DNAT: a client and a backend routed through a node, and the loads
between them taking turns."""

from __future__ import annotations

import statistics
import subprocess
import sys
from contextlib import ExitStack

from bench.proxy_cluster import ENDPOINTS, PORT, REMOTE_NODE, TARGET_PORT
from bench.proxy_daemon import KNIT, Daemon
from bench.proxy_modes import Mode, Saved
from bench.proxy_netns import make_netns
from bench.proxy_report import CONNECTIONS, Results, paired, times
from deploy.lab.controlplane import die_with_parent
from deploy.lab.kube import SERVICES, SLICES, Kube, endpoint
from deploy.lab.netns import Netns
from deploy.lab.process import eventually

CLIENT, CLIENT_GATEWAY = "10.244.200.2", "10.244.200.1"
BACKEND_GATEWAY = "10.244.201.1"
BACKENDS = [f"10.244.201.{host}" for host in range(2, 3 + ENDPOINTS)]
"""The target service's endpoints, and one more address for the direct connections."""
CONNECTION_GOAL = 0.8
"""nftables: connections/s through a ClusterIP at the largest N, as a share of direct through
a node without rules."""
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


class Connections:
    """Connection loads through a node, and knit-proxyd's figures of them."""

    def __init__(self, kube: Kube, results: Results, quick: bool) -> None:
        self.kube = kube
        self.results = results
        self.quick = quick
        self.targets: dict[str, str] = {}
        """mode -> the service knit-proxyd's connections went through."""

    def measure(
        self, size: int, mode: Mode, daemon: Daemon, saved: Saved, stack: ExitStack
    ) -> None:
        """Connections/s through the mode's target service, against direct ones and one
        verdict-map DNAT, each a row of the report."""
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
        self.results.keep(mode, size, CONNECTIONS, KNIT, share)
        figure = f"TCP connections/s via ClusterIP ({how})"
        self.results.add(
            mode,
            size,
            figure,
            f"{spread['service']}, {dispatch}",
            plain,
            times(share),
            (f">= {CONNECTION_GOAL:.0%} of direct without rules", share >= CONNECTION_GOAL),
        )
        self.results.add(
            mode,
            size,
            f"{figure}, against direct through this node",
            spread["service"],
            direct,
            times(paired(rates, "service", "direct")),
        )
        self.results.add(
            mode,
            size,
            f"TCP connections/s direct to the backend, through this node ({how})",
            spread["direct"],
            plain,
            times(paired(rates, "direct", "plain")),
        )
        self.results.add(
            mode,
            size,
            f"{figure}, against one verdict-map DNAT through a node without other rules",
            spread["service"],
            f"one-lookup DNAT {spread['nat']}",
            times(paired(rates, "service", "nat")),
        )
        self.results.add(
            mode,
            size,
            f"TCP connections/s through one verdict-map DNAT and nothing else ({how})",
            f"one-lookup DNAT {spread['nat']}",
            plain,
            times(paired(rates, "nat", "plain")),
        )

    def load_time(self) -> tuple[float, int]:
        """(seconds of one connection load, rounds of loads)."""
        return (1.0, 2) if self.quick else (2.0, 7)

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
