"""NetworkPolicy and ClusterNetworkPolicy enforced by knit-proxyd, proven by packets between
real pods: two nodes on
different segments (so traffic between them crosses VXLAN), pods attached by libcni, their
Pod objects in the API with the addresses the plugin gave them, and policies created there.

Each check waits until the policy's effect is seen (a sync follows a change within a fraction
of a second), then makes the other checks once: a denied TCP connection is one whose SYN is
dropped, so the client's 3 s connect timeout ends it.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from deploy.lab.cluster import Cluster, LabNode, LabPod
from deploy.lab.controlplane import ControlPlane
from deploy.lab.held import HeldConnection
from deploy.lab.kube import Kube, api_client, pod_object, pod_status
from deploy.lab.netns import ECHO, remove_namespace, unique_name
from deploy.lab.process import eventually, in_ns
from proxyd.policy import flow_server
from proxyd.policy.render import TABLE

PYTHON = sys.executable
UDP_PORT = 5353
SCTP_PORT = 9132
SCTP_SOCKETS = "SCTP" in Path("/proc/net/protocols").read_text()
"""The development kernel has none; the VM node's has (tests/vm runs the SCTP test there)."""
POLICIES = "/apis/networking.k8s.io/v1/namespaces/{}/networkpolicies"
CLUSTER_POLICIES = "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies"
CRD = Path(__file__).parents[2] / "deploy" / "kubernetes" / "clusternetworkpolicies.yaml"


@dataclass
class World:
    cluster: Cluster
    x: str
    """Namespace of the server and of the near client."""
    y: str
    """Namespace of the far client."""
    server: LabPod
    near: LabPod
    """On the server's node."""
    far: LabPod
    """On the other node, across VXLAN."""


def _namespace(cluster: Cluster, name: str) -> str:
    cluster.kube.create_namespace(name)
    return name


def _pod(
    cluster: Cluster, namespace: str, node: str, role: str, ports: list[tuple[str, int, str]]
) -> LabPod:
    pod = cluster.add_pod(cluster.nodes[node], unique_name(role))
    obj = pod_object(pod.name, node, {"role": role}, ports)
    cluster.kube.create_running_pod(namespace, obj, pod.addresses)
    return pod


@pytest.fixture(scope="module")
def world(
    control_plane: ControlPlane, cni_bundle: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    folder = tmp_path_factory.mktemp("policy") / "lab"
    admin = Kube(api_client(control_plane.kubeconfig))
    # installed before the daemons start, which otherwise look for it again only every 30 s
    crd = admin.install_crd(CRD)
    with contextlib.ExitStack() as stack:
        stack.callback(admin.api.close)
        stack.callback(admin.delete, crd)
        cluster = stack.enter_context(Cluster(unique_name("np"), folder, control_plane, cni_bundle))
        lan1 = cluster.add_segment("lan1", "10.78.1.0/24", "fd78:1::/64")
        lan2 = cluster.add_segment("lan2", "10.78.2.0/24", "fd78:2::/64")
        cluster.add_node("a", lan1, 11, ("10.244.1.0/24", "fd10:244:0:1::/64"))
        cluster.add_node("c", lan2, 13, ("10.244.3.0/24", "fd10:244:0:3::/64"))
        x = _namespace(cluster, unique_name("x"))
        y = _namespace(cluster, unique_name("y"))
        ports = [("web", 80, "TCP"), ("alt", 81, "TCP"), ("dns", UDP_PORT, "UDP")]
        server = _pod(cluster, x, "a", "server", [*ports, ("assoc", SCTP_PORT, "SCTP")])
        cluster.serve(server.ns, 81, cluster.folder / "server-81.log")
        served = [("udp", UDP_PORT), *([("sctp", SCTP_PORT)] if SCTP_SOCKETS else [])]
        for proto, port in served:
            serve = [PYTHON, str(ECHO), "serve", "::", str(port), proto]
            log = cluster.folder / f"server-{proto}.log"
            cluster.spawn(["ip", "netns", "exec", server.ns, *serve], log)
        near = _pod(cluster, x, "a", "near", [])
        far = _pod(cluster, y, "c", "far", [("web", 80, "TCP")])
        yield World(cluster, x, y, server, near, far)


@pytest.fixture
def policies(world: World) -> Iterator[list[str]]:
    """Paths of the policies a test made, deleted after it, and the effect waited for."""
    made: list[str] = []
    yield made
    for path in made:
        world.cluster.kube.delete(path)
    eventually(
        lambda: (
            reaches(world.near, world.server.address(4), 80)
            and reaches(world.far, world.server.address(4), 80)
            and reaches(world.server, world.far.address(4), 80)
        ),
        30,
        what="everything allowed again once the policies are gone",
    )


def reaches(client: LabPod, host: str, port: int, proto: str = "tcp") -> bool:
    out = in_ns(
        client.ns, PYTHON, str(ECHO), "request", host, str(port), proto, check=False, timeout=15
    )
    return bool(out.strip())


def apply(world: World, made: list[str], spec: dict[str, Any]) -> str:
    """A policy of the server's namespace, deleted after the test."""
    name = unique_name("policy")
    path = POLICIES.format(world.x)
    world.cluster.kube.create(path, {"metadata": {"name": name}, "spec": spec})
    made.append(f"{path}/{name}")
    return name


def denied_packets(node: LabNode, labels: str) -> float:
    """The node's knit_network_policy_denied_packets_total series with exactly these labels."""
    return series(node, "knit_network_policy_denied_packets_total", labels)


def series(node: LabNode, metric: str, labels: str) -> float:
    """The node's series of the metric with exactly these labels."""
    url = "http://127.0.0.1:10249/metrics"
    text = in_ns(
        node.ns,
        PYTHON,
        "-c",
        f"import urllib.request as u; print(u.urlopen({url!r}).read().decode())",
    )
    wanted = f"{metric}{{{labels}}} "
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(wanted))


def settles(client: LabPod, host: str, port: int, allowed: bool, proto: str = "tcp") -> None:
    """Wait until the connection's verdict is `allowed`."""
    verdict = "allowed" if allowed else "denied"
    eventually(
        lambda: reaches(client, host, port, proto) == allowed,
        30,
        what=f"{client.name} -> {host}:{port}/{proto} {verdict}",
    )


SERVER = {"matchLabels": {"role": "server"}}


def test_without_a_policy_everything_is_allowed(world: World) -> None:
    for client in (world.near, world.far):
        for family in (4, 6):
            assert reaches(client, world.server.address(family), 80)


def test_deny_all_ingress_isolates_only_the_selected_pod(world: World, policies: list[str]) -> None:
    name = apply(world, policies, {"podSelector": SERVER, "policyTypes": ["Ingress"]})
    settles(world.far, world.server.address(4), 80, allowed=False)
    assert not reaches(world.near, world.server.address(4), 80)
    assert not reaches(world.far, world.server.address(6), 80)
    # the near pod is not selected; the server's own connections out are answered (replies of
    # an allowed connection pass although the server is isolated for ingress)
    assert reaches(world.server, world.near.address(4), 80)
    assert reaches(world.server, world.far.address(4), 80)
    # the node's own traffic to its pods stays allowed (kubelet probes)
    node = world.cluster.nodes["a"]
    out = in_ns(node.ns, PYTHON, str(ECHO), "request", world.server.address(4), "80", check=False)
    assert out.strip()
    # the SYNs dropped so far, counted for the server's namespace and the policy isolating it
    labels = f'direction="ingress",namespace="{world.x}",policies="{name}"'
    assert denied_packets(node, labels) >= 2


def test_pod_selector_allows_pods_of_the_policy_namespace(
    world: World, policies: list[str]
) -> None:
    apply(
        world,
        policies,
        {
            "podSelector": SERVER,
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "far"}}}]}],
        },
    )
    settles(world.near, world.server.address(4), 80, allowed=False)
    # the far pod has the label, but lives in another namespace
    assert not reaches(world.far, world.server.address(4), 80)


def test_namespace_and_pod_selectors_in_one_peer_are_both_required(
    world: World, policies: list[str]
) -> None:
    peer = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": world.y}},
        "podSelector": {"matchExpressions": [{"key": "role", "operator": "In", "values": ["far"]}]},
    }
    apply(world, policies, {"podSelector": SERVER, "ingress": [{"from": [peer]}]})
    settles(world.near, world.server.address(4), 80, allowed=False)
    assert reaches(world.far, world.server.address(4), 80)
    assert reaches(world.far, world.server.address(6), 80)


def test_ip_block_except_carves_out_an_address(world: World, policies: list[str]) -> None:
    block = {"cidr": "10.244.0.0/16", "except": [f"{world.far.address(4)}/32"]}
    apply(
        world,
        policies,
        {"podSelector": SERVER, "ingress": [{"from": [{"ipBlock": block}]}]},
    )
    settles(world.far, world.server.address(4), 80, allowed=False)
    assert reaches(world.near, world.server.address(4), 80)
    # the block is IPv4: nothing of IPv6 is allowed
    assert not reaches(world.near, world.server.address(6), 80)


def test_ports_by_number_range_and_name(world: World, policies: list[str]) -> None:
    apply(
        world,
        policies,
        {
            "podSelector": SERVER,
            "ingress": [{"ports": [{"port": "alt"}, {"port": UDP_PORT, "protocol": "UDP"}]}],
        },
    )
    settles(world.near, world.server.address(4), 80, allowed=False)
    assert reaches(world.far, world.server.address(4), 81)
    assert reaches(world.far, world.server.address(4), UDP_PORT, "udp")
    apply(
        world,
        policies,
        {"podSelector": SERVER, "ingress": [{"ports": [{"port": 79, "endPort": 80}]}]},
    )
    settles(world.near, world.server.address(4), 80, allowed=True)
    assert reaches(world.far, world.server.address(6), 80)


def test_egress_by_named_port_of_the_peer_and_isolation_per_direction(
    world: World, policies: list[str]
) -> None:
    apply(
        world,
        policies,
        {
            "podSelector": {"matchLabels": {"role": "near"}},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"podSelector": SERVER}], "ports": [{"port": "alt"}]}],
        },
    )
    settles(world.near, world.server.address(4), 80, allowed=False)
    assert reaches(world.near, world.server.address(4), 81)
    assert not reaches(world.near, world.far.address(4), 80)
    # egress isolation says nothing about ingress
    assert reaches(world.far, world.near.address(4), 80)


def test_service_traffic_is_judged_by_the_backend_with_the_client_address(
    world: World, policies: list[str]
) -> None:
    service = world.cluster.publish(unique_name("svc"), [world.server])
    cluster_ip = service["spec"]["clusterIPs"][0]
    settles(world.far, cluster_ip, 80, allowed=True)
    peer = {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"role": "near"}},
    }
    apply(world, policies, {"podSelector": SERVER, "ingress": [{"from": [peer]}]})
    settles(world.far, cluster_ip, 80, allowed=False)
    assert reaches(world.near, cluster_ip, 80)


def isolate_the_server(world: World, policies: list[str]) -> LabNode:
    """A policy denying all ingress to the server, in the kernel; the server's node."""
    apply(world, policies, {"podSelector": SERVER, "policyTypes": ["Ingress"]})
    settles(world.near, world.server.address(4), 80, allowed=False)
    return world.cluster.nodes["a"]


@contextlib.contextmanager
def restarted_with(world: World, node: LabNode, *flags: str) -> Iterator[None]:
    """The node's daemon restarted with flags for the block, and as before after it."""
    world.cluster.stop_daemon(node)
    try:
        world.cluster.start_daemon(node, *flags)
        yield
    finally:
        world.cluster.stop_daemon(node)
        world.cluster.start_daemon(node)


def test_switched_off_the_daemon_removes_its_policy_tables(
    world: World, policies: list[str]
) -> None:
    node = isolate_the_server(world, policies)
    with restarted_with(world, node, "--network-policy=false"):
        eventually(lambda: TABLE not in in_ns(node.ns, "nft", "list", "tables"), 30)
        assert reaches(world.near, world.server.address(4), 80)
    settles(world.near, world.server.address(4), 80, allowed=False)


def test_a_restarted_daemon_replaces_the_table_it_left_whole(
    world: World, policies: list[str]
) -> None:
    node = isolate_the_server(world, policies)

    def tables() -> list[str]:
        # stateless: the new table's counters start again from zero
        return [in_ns(node.ns, "nft", "-s", "list", "table", f, TABLE) for f in ("ip", "ip6")]

    left = tables()
    world.cluster.stop_daemon(node)
    logged = node.log.stat().st_size
    world.cluster.start_daemon(node)

    def synced() -> bool:
        with node.log.open() as log:
            log.seek(logged)
            return "policy sync: " in log.read()

    eventually(synced, 30, "the first policy sync after the restart")
    assert tables() == left, "the table in the kernel at start is replaced, not added to"
    assert not reaches(world.near, world.server.address(4), 80)


def test_denied_connections_are_logged_with_their_pod(world: World, policies: list[str]) -> None:
    node = world.cluster.nodes["a"]
    with restarted_with(world, node, "--network-policy-log-rate=5"):
        name = apply(world, policies, {"podSelector": SERVER, "policyTypes": ["Ingress"]})
        settles(world.far, world.server.address(4), 80, allowed=False)
        line = (
            f"policy denied ingress to {world.x}/{world.server.name} (judged by {name}): "
            f"tcp {world.far.address(4)} -> {world.server.address(4)}:80"
        )
        eventually(lambda: line in node.log.read_text(), 10, what="the denial logged")


def test_flow_records_name_the_deciding_rule_and_count_per_policy(
    world: World, policies: list[str]
) -> None:
    node = world.cluster.nodes["a"]
    with restarted_with(world, node, "--flow-records-rate=100"):
        peer = {"podSelector": {"matchLabels": {"role": "near"}}}
        name = apply(world, policies, {"podSelector": SERVER, "ingress": [{"from": [peer]}]})
        server = world.server.address(4)
        settles(world.far, server, 80, allowed=False)
        assert reaches(world.near, server, 80)
        path = str(node.socket.parent / "flows.sock")

        def records(client: LabPod, verdict: str) -> list[dict[str, Any]]:
            pod = {"namespace": world.x if client is world.near else world.y, "name": client.name}
            return [
                r
                for r in flow_server.read(path, follow=False)
                if r["verdict"] == verdict
                and r["source"] == {"address": client.address(4), "port": r["source"]["port"],
                                    "pod": pod}
                and r["destination"]["address"] == server and r["destination"]["port"] == 80
            ]  # fmt: skip

        eventually(lambda: records(world.near, "allow"), 10, what="the allowed connection recorded")
        allowed = records(world.near, "allow")[-1]
        assert allowed["node"] == "a" and allowed["direction"] == "ingress"
        assert allowed["destination"]["pod"] == {"namespace": world.x, "name": world.server.name}
        by = allowed["decidedBy"]
        assert (by["kind"], by["namespace"], by["name"], by["rule"], by["action"]) == (
            "NetworkPolicy", world.x, name, 0, "Accept",
        )  # fmt: skip
        denied = records(world.far, "deny")
        assert denied, "the denied connections recorded"
        by = denied[-1]["decidedBy"]
        assert (by["kind"], by["namespace"], by["name"], by["rule"]) == (
            "NetworkPolicy", world.x, name, None,
        )  # fmt: skip
        labels = f'kind="NetworkPolicy",name="{name}",namespace="{world.x}",verdict='
        total = "knit_network_policy_connections_total"
        assert series(node, total, labels + '"allow"') >= 1
        assert series(node, total, labels + '"deny"') >= len(denied)
        lost = "knit_network_policy_flow_records_lost_total"
        assert series(node, lost, 'reason="limit"') == 0
        assert series(node, lost, 'reason="buffer"') == 0


def test_a_staged_default_deny_passes_every_probe_and_flows_say_would_deny(
    world: World, policies: list[str]
) -> None:
    node = world.cluster.nodes["a"]
    with restarted_with(world, node, "--flow-records-rate=100"):
        name = unique_name("staged")
        path = POLICIES.format(world.x)
        annotations = {"knit.dev/staged": "true"}
        spec = {"podSelector": {}, "policyTypes": ["Ingress"]}
        world.cluster.kube.create(
            path, {"metadata": {"name": name, "annotations": annotations}, "spec": spec}
        )
        policies.append(f"{path}/{name}")
        server = world.server.address(4)
        flows = str(node.socket.parent / "flows.sock")

        def would_deny(client: LabPod) -> list[dict[str, Any]]:
            return [
                r
                for r in flow_server.read(flows, follow=False)
                if r["source"]["address"] == client.address(4)
                and r["destination"] == {"address": server, "port": 80,
                                         "pod": {"namespace": world.x, "name": world.server.name}}
                and r["verdict"] == "allow" and r["staged"] is not None
            ]  # fmt: skip

        for client in (world.near, world.far):
            eventually(
                lambda client=client: reaches(client, server, 80) and would_deny(client),
                30,
                what=f"{client.name}'s probe passes and is recorded as would-deny",
            )
            for family in (4, 6):
                assert reaches(client, world.server.address(family), 80), "the verdict stays"
            record = would_deny(client)[-1]
            assert record["decidedBy"]["kind"] == "Default"
            staged = record["staged"]
            assert staged["verdict"] == "deny"
            by = staged["decidedBy"]
            assert (by["kind"], by["namespace"], by["name"], by["rule"]) == (
                "NetworkPolicy", world.x, name, None,
            )  # fmt: skip
        labels = f'kind="NetworkPolicy",name="{name}",namespace="{world.x}",verdict="deny"'
        counted = series(node, "knit_network_policy_staged_connections_total", labels)
        assert counted >= 2


def udp_from_a_fixed_port(client: LabPod, host: str) -> bool:
    """A UDP request from one source port: every request is the same conntrack entry."""
    argv = [PYTHON, str(ECHO), "request", host, str(UDP_PORT), "udp", "40053"]
    return bool(in_ns(client.ns, *argv, check=False, timeout=15).strip())


def test_a_tightened_policy_cuts_the_open_connections_it_denies(
    world: World, policies: list[str]
) -> None:
    server = world.server.address(4)
    with (
        HeldConnection(world.far.ns, server, 80) as far,
        HeldConnection(world.near.ns, world.server.address(6), 80) as near,
    ):
        assert udp_from_a_fixed_port(world.far, server)
        changed = time.monotonic()
        peer = {"podSelector": {"matchLabels": {"role": "near"}}}
        apply(world, policies, {"podSelector": SERVER, "ingress": [{"from": [peer]}]})
        cut = far.cut_after(changed, limit=10)
        assert not udp_from_a_fixed_port(world.far, server)
        assert near.exchange(), "a connection the policy allows stays open"
        print(f"the denied TCP connection was cut {cut:.2f} s after the policy was created")


def test_a_cut_connection_on_one_bridge_resumes_when_a_change_allows_it_again(
    world: World, policies: list[str]
) -> None:
    with HeldConnection(world.near.ns, world.server.address(4), 80) as near:
        changed = time.monotonic()
        peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": world.y}}}
        apply(world, policies, {"podSelector": SERVER, "ingress": [{"from": [peer]}]})
        near.cut_after(changed, limit=10)
        # the server's delayed ACKs and the client's retransmissions do not revive it
        time.sleep(1)
        assert not near.exchange()
        world.cluster.kube.delete(policies.pop())
        eventually(near.exchange, 30, what="the connection answering again")


def test_kept_connections_stay_open_when_a_policy_denies_them(
    world: World, policies: list[str]
) -> None:
    node = world.cluster.nodes["a"]
    with (
        restarted_with(world, node, "--network-policy-existing-connections=keep"),
        HeldConnection(world.far.ns, world.server.address(4), 80) as far,
    ):
        apply(world, policies, {"podSelector": SERVER, "policyTypes": ["Ingress"]})
        settles(world.far, world.server.address(4), 80, allowed=False)
        assert far.exchange(), "opened before the policy, the connection stays open"


PROBE_PORT = 9999
STARTS = 40
"""Pod starts per direction; the first is a control no policy isolates."""
STATUS_LAG = 0.3
"""How long after the ADD the test writes the pod's addresses into its status, as kubelet
does once the sandbox is up: the window in which policies keyed on the status alone would
not judge the pod."""
HEARD = """
import ipaddress, select, socket, sys
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", int(sys.argv[1])))
for host in (host for net in sys.argv[2:] for host in ipaddress.ip_network(net)):
    sock.sendto(b"x", (str(host), int(sys.argv[1])))
print("ready", flush=True)
sources = set()
while not select.select([sys.stdin], [], [], 0)[0]:
    if select.select([sock], [], [], 0.01)[0]:
        sources.add(sock.recvfrom(64)[1][0])
print(" ".join(sorted(sources)) or "-", flush=True)
"""
"""Listens for UDP datagrams on a port until stdin has input, then prints the sources it heard;
first sends one from that port to the same port of every address of the networks given."""
SPRAY = """
import ipaddress, select, socket, sys
port, source_port = int(sys.argv[1]), int(sys.argv[2])
targets = [str(host) for net in sys.argv[3:] for host in ipaddress.ip_network(net)]
sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
sock.bind(("0.0.0.0", source_port))
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    for target in targets:
        try:
            sock.sendto(b"x", (target, port))
        except OSError:  # before the sender's namespace has an address and a route
            pass
print("-", flush=True)
"""
"""Sends a datagram to a port of every address of the networks, from a source port (0: any),
round after round, until stdin has input."""


class Background:
    """A script run in a namespace until finish(), which returns its last line."""

    def __init__(self, netns: str, script: str, *args: str) -> None:
        argv = ["ip", "netns", "exec", netns, PYTHON, "-c", script, *args]
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self._in, self._out = self.process.stdin, self.process.stdout
        assert self._out.readline().strip() == "ready"

    def finish(self) -> str:
        self._in.write("\n")
        self._in.flush()
        line = self._out.readline().strip()
        self.process.wait(10)
        return line

    def __enter__(self) -> Background:
        return self

    def __exit__(self, *_: object) -> None:
        self.process.kill()
        self.process.wait()


def start_pod(
    world: World,
    role: str,
    heard_in_pod: bool,
    target: str,
    lag: float = STATUS_LAG,
    source_port: int = 0,
) -> tuple[str, str]:
    """A pod of the server's namespace started on node a as kubelet would (its Pod object
    without an address, the sandbox's CNI ADD, its status some time later), with HEARD
    listening in it from before the ADD (heard_in_pod) or SPRAY sending from it (from
    `source_port`) to `target`; its address and what HEARD printed, when it listened."""
    cluster, node = world.cluster, world.cluster.nodes["a"]
    name = unique_name(role)
    ns = cluster.add_namespace(f"{name}-ns")
    script, args = (
        (HEARD, [str(PROBE_PORT)])
        if heard_in_pod
        else (SPRAY, [str(PROBE_PORT), str(source_port), target])
    )
    pods = f"/api/v1/namespaces/{world.x}/pods"
    with Background(ns, script, *args) as inside:
        cluster.kube.create(pods, pod_object(name, node.name, {"role": role}))
        try:
            result = json.loads(cluster.cni(node, "add", ns, name, namespace=world.x))
            address = result["ips"][0]["address"].split("/")[0]
            time.sleep(lag)
            cluster.kube.call(
                "PATCH", f"{pods}/{name}/status", pod_status([address]),
                "application/merge-patch+json",
            )  # fmt: skip
            time.sleep(0.1)
            heard = inside.finish()
        finally:
            cluster.cni(node, "del", ns, name, namespace=world.x)
            cluster.kube.delete(f"{pods}/{name}")
            remove_namespace(ns)
    return address, heard


def test_an_isolated_pod_is_judged_from_its_first_packet_in(
    world: World, policies: list[str]
) -> None:
    apply(world, policies, {"podSelector": {"matchLabels": {"role": "fresh"}}})
    got_in = []
    with Background(world.far.ns, SPRAY, str(PROBE_PORT), "0", "10.244.1.0/24") as spray:
        # the node resolves the control's address only once it answers: time for that
        address, heard = start_pod(world, "open", heard_in_pod=True, target="", lag=3)
        assert world.far.address(4) in heard.split(), "the control, isolated by nothing, hears"
        for _ in range(STARTS - 1):
            address, heard = start_pod(world, "fresh", heard_in_pod=True, target="")
            if world.far.address(4) in heard.split():
                got_in.append(address)
        spray.finish()
    assert got_in == [], "the far pod's datagrams reached isolated pods"


def test_an_isolated_pod_is_judged_from_its_first_packet_out(
    world: World, policies: list[str]
) -> None:
    policy = {"podSelector": {"matchLabels": {"role": "fresh"}}, "policyTypes": ["Egress"]}
    apply(world, policies, policy)
    far = world.far.address(4)
    with Background(world.far.ns, HEARD, str(PROBE_PORT)) as listener:
        control, _ = start_pod(world, "open", heard_in_pod=False, target=f"{far}/32", lag=3)
        started = [
            start_pod(world, "fresh", heard_in_pod=False, target=f"{far}/32")[0]
            for _ in range(STARTS - 1)
        ]
        heard = listener.finish().split()
    assert control in heard, "the control, isolated by nothing, was heard"
    assert set(started) & set(heard) == set(), "isolated pods' datagrams reached the far pod"


def test_a_pod_sends_nothing_back_along_a_flow_tried_before_it_existed(
    world: World, policies: list[str]
) -> None:
    """The far pod sends a datagram to every address of the node's pod range before each pod
    starts, leaving a conntrack entry for each; the new pod, isolated both ways, then sends
    along one in its reply direction, which would pass as established were the entry kept.
    With existing connections kept, no cut marks such an entry either."""
    node, far = world.cluster.nodes["a"], world.far.address(4)
    both = {"podSelector": {"matchLabels": {"role": "fresh"}}, "policyTypes": ["Ingress", "Egress"]}
    heard_from = []
    with restarted_with(world, node, "--network-policy-existing-connections=keep"):
        apply(world, policies, both)
        for role, lag in [("open", 3.0)] + [("fresh", STATUS_LAG)] * (STARTS // 4):
            with Background(world.far.ns, HEARD, str(PROBE_PORT), "10.244.1.0/24") as listener:
                address, _ = start_pod(
                    world, role, False, f"{far}/32", lag=lag, source_port=PROBE_PORT
                )
                heard = listener.finish().split()
            if role == "open":
                assert address in heard, "the control, isolated by nothing, was heard"
            elif address in heard:
                heard_from.append(address)
    assert heard_from == [], "isolated pods' datagrams passed as replies"


# ---------------------------------------------------------------- ClusterNetworkPolicy


def apply_cluster_policy(
    world: World, made: list[str], tier: str, priority: int, **rules: Any
) -> str:
    """A cluster policy whose subject is the server, deleted after the test."""
    name = unique_name("cnp")
    subject = {
        "pods": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": world.x}},
            "podSelector": SERVER,
        }
    }
    spec = {"tier": tier, "priority": priority, "subject": subject, **rules}
    obj = {
        "apiVersion": "policy.networking.k8s.io/v1alpha2",
        "kind": "ClusterNetworkPolicy",
        "metadata": {"name": name},
        "spec": spec,
    }
    world.cluster.kube.create(CLUSTER_POLICIES, obj)
    made.append(f"{CLUSTER_POLICIES}/{name}")
    return name


def from_namespace(action: str, namespace: str) -> dict[str, Any]:
    selector = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    return {"action": action, "from": [{"namespaces": selector}]}


def test_admin_deny_overrides_networkpolicy_and_a_higher_admin_accept_overrides_it(
    world: World, policies: list[str]
) -> None:
    apply(world, policies, {"podSelector": SERVER, "ingress": [{}]})
    apply_cluster_policy(world, policies, "Admin", 10, ingress=[from_namespace("Deny", world.y)])
    settles(world.far, world.server.address(4), 80, allowed=False)
    assert not reaches(world.far, world.server.address(6), 80)
    assert reaches(world.near, world.server.address(4), 80)
    apply_cluster_policy(world, policies, "Admin", 5, ingress=[from_namespace("Accept", world.y)])
    settles(world.far, world.server.address(4), 80, allowed=True)


def test_admin_accept_overrides_a_networkpolicy_isolating_the_pod(
    world: World, policies: list[str]
) -> None:
    apply(world, policies, {"podSelector": SERVER, "policyTypes": ["Ingress"]})
    settles(world.near, world.server.address(4), 80, allowed=False)
    apply_cluster_policy(world, policies, "Admin", 5, ingress=[from_namespace("Accept", world.y)])
    settles(world.far, world.server.address(4), 80, allowed=True)
    assert not reaches(world.near, world.server.address(4), 80)


def test_an_admin_pass_skips_lower_admin_rules_and_leaves_the_decision_to_networkpolicy(
    world: World, policies: list[str]
) -> None:
    deny_all = {"action": "Deny", "from": [{"namespaces": {}}]}
    apply_cluster_policy(world, policies, "Admin", 20, ingress=[deny_all])
    settles(world.near, world.server.address(4), 80, allowed=False)
    apply_cluster_policy(world, policies, "Admin", 10, ingress=[from_namespace("Pass", world.y)])
    settles(world.far, world.server.address(4), 80, allowed=True)
    assert not reaches(world.near, world.server.address(4), 80)
    # passed on, the far pod's traffic is now NetworkPolicy's to decide
    peer = {"podSelector": {"matchLabels": {"role": "near"}}}
    apply(world, policies, {"podSelector": SERVER, "ingress": [{"from": [peer]}]})
    settles(world.far, world.server.address(4), 80, allowed=False)


def test_baseline_applies_only_to_pods_no_networkpolicy_isolates(
    world: World, policies: list[str]
) -> None:
    apply_cluster_policy(world, policies, "Baseline", 10, ingress=[from_namespace("Deny", world.y)])
    settles(world.far, world.server.address(4), 80, allowed=False)
    assert reaches(world.near, world.server.address(4), 80)
    # a NetworkPolicy selecting the server decides alone: it allows the far pod
    peer = {"namespaceSelector": {}}
    apply(world, policies, {"podSelector": SERVER, "ingress": [{"from": [peer]}]})
    settles(world.far, world.server.address(4), 80, allowed=True)


@pytest.mark.skipif(not SCTP_SOCKETS, reason="no SCTP sockets here; tests/vm runs it")
def test_sctp_is_judged_by_protocol_and_port_by_both_policy_apis(
    world: World, policies: list[str]
) -> None:
    """SCTP associations, by packets: a NetworkPolicy port without a protocol is TCP's, one
    naming SCTP lets the association in, and an admin Deny of SCTP outranks it."""
    server = world.server.address(4)
    assert reaches(world.far, server, SCTP_PORT, "sctp")
    apply(world, policies, {"podSelector": SERVER, "ingress": [{"ports": [{"port": SCTP_PORT}]}]})
    settles(world.far, server, SCTP_PORT, allowed=False, proto="sctp")
    sctp = {"port": SCTP_PORT, "protocol": "SCTP"}
    apply(world, policies, {"podSelector": SERVER, "ingress": [{"ports": [sctp]}]})
    settles(world.far, server, SCTP_PORT, allowed=True, proto="sctp")
    assert reaches(world.far, world.server.address(6), SCTP_PORT, "sctp")
    assert not reaches(world.far, server, 80), "the policies let in SCTP alone"
    denied = {
        **from_namespace("Deny", world.y),
        "protocols": [{"sctp": {"destinationPort": {"number": SCTP_PORT}}}],
    }
    apply_cluster_policy(world, policies, "Admin", 10, ingress=[denied])
    settles(world.far, server, SCTP_PORT, allowed=False, proto="sctp")
    assert reaches(world.near, server, SCTP_PORT, "sctp"), "the Deny names the far namespace"


def test_admin_egress_to_networks_and_ports(world: World, policies: list[str]) -> None:
    far = world.far.address(4)
    rules = [
        {
            "action": "Deny",
            "to": [{"networks": [f"{far}/32"]}],
            "protocols": [{"tcp": {"destinationPort": {"number": 80}}}],
        }
    ]
    apply_cluster_policy(world, policies, "Admin", 10, egress=rules)
    settles(world.server, far, 80, allowed=False)
    assert reaches(world.server, world.near.address(4), 80)
    assert reaches(world.server, world.far.address(6), 80)
