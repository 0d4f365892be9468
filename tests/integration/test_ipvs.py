"""The IPVS datapath in network namespaces.

Here (no IPVS, no dummy links in this kernel): the ipsets and their members, the iptables
rules loaded by iptables-restore and read back, and the proxier's full and partial syncs with
a fake IPVS socket. Where /proc/net/ip_vs exists (`make test` on a kernel with IPVS; the kind
workflow runs Kubernetes' e2e tests instead): real virtual servers, traffic through them, and
graceful removal of a real server with a live connection.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pytest

from cni.kernel.addresses import LinkAddress
from deploy.lab.netns import Netns
from proxyd import proxier as proxier_module
from proxyd.daemon import SYSCTLS_FOR_ROUTING
from proxyd.iptables.kernel import IptablesKernel
from proxyd.iptables.restore import RuleSet
from proxyd.ipvs import dummy, names
from proxyd.ipvs import netlink as ipvs_netlink
from proxyd.ipvs import proxier as ipvs_proxier
from proxyd.ipvs.desired import Frontend, RealServer
from proxyd.ipvs.ipsets import Ipsets
from proxyd.ipvs.netlink import IpvsKernel, IpvsUnavailable, open_socket
from proxyd.ipvs.proxier import IpvsProxier
from proxyd.ipvs.rules import render
from proxyd.metrics import Metrics
from proxyd.model import Endpoint, NodeInfo, ServicePort, ServicePortName
from proxyd.port_plan import FamilyContext, plan_port
from proxyd.proxier import ProgramError, ProxyOptions
from tests.support.example_service import changes
from tests.support.ipvs_doubles import FakeIpvs

HAS_IPVS = os.path.exists("/proc/net/ip_vs")
needs_ipvs = pytest.mark.skipif(not HAS_IPVS, reason="the kernel has no IPVS (/proc/net/ip_vs)")

NODE = NodeInfo("node-a", addresses=("192.0.2.10",))
OPTIONS = ProxyOptions(cluster_cidrs=("10.244.0.0/16", "fd10::/48"))
NAME = ServicePortName("ns", "web", "http", "TCP")
PORT = ServicePort(name=NAME, cluster_ips=("10.96.0.10",), port=80, node_port=30080)
POD = Endpoint("10.244.1.5", 8080, node_name="node-a")
DUMMY_INDEX = 99
"""The faked dummy link's index."""


def ipset_save(ns: Netns) -> str:
    return ns.run("ipset", "save").stdout


def members(saved: str, name: str) -> set[str]:
    prefix = f"add {name} "
    return {line[len(prefix) :] for line in saved.splitlines() if line.startswith(prefix)}


def test_sets_are_created_filled_and_swapped(make_netns: Callable[[str], Netns]) -> None:
    ns = make_netns("ipvs")
    with ns.entered():
        for family in (4, 6):
            Ipsets(family).ensure()
        sets = Ipsets(4)
        sets.update(
            [
                ("CLUSTER-IP", "10.96.0.10,tcp:80"),
                ("LOOP-BACK", "10.244.1.5,udp:53,10.244.1.5"),
                ("LOAD-BALANCER-SOURCE-CIDR", "203.0.113.7,sctp:80,198.51.100.0/24"),
                ("NODE-PORT-TCP", "30080"),
                ("IPVS-IPS", "10.96.0.10"),
            ],
            [],
        )
        sets.update([("CLUSTER-IP", "10.96.0.11,tcp:80")], [("CLUSTER-IP", "10.96.0.10,tcp:80")])
        sets.update([], [("CLUSTER-IP", "10.96.0.99,tcp:80")])
        Ipsets(6).replace(names.CLUSTER_IP, ["fd00::10,tcp:80", "fd00::11,udp:53"])
        assert sets.ports(["NODE-PORT-TCP", "NODE-PORT-UDP"]) == {
            "NODE-PORT-TCP": {30080},
            "NODE-PORT-UDP": set(),
        }
        assert Ipsets(4).ports(["NO-SUCH-SET"]) == {"NO-SUCH-SET": set()}
    saved = ipset_save(ns)
    for spec in names.SETS:
        assert f"create {names.set_name(spec.key, 4)} {spec.type} " in saved
        assert f"create {names.set_name(spec.key, 6)} {spec.type} " in saved
    assert "create KNIT6-CLUSTER-IP hash:ip,port family inet6" in saved
    assert members(saved, "KNIT-CLUSTER-IP") == {"10.96.0.11,tcp:80"}
    assert members(saved, "KNIT-LOOP-BACK") == {"10.244.1.5,udp:53,10.244.1.5"}
    assert members(saved, "KNIT-LOAD-BALANCER-SOURCE-CIDR") == {
        "203.0.113.7,sctp:80,198.51.100.0/24"
    }
    assert members(saved, "KNIT-NODE-PORT-TCP") == {"30080"}
    assert members(saved, "KNIT6-CLUSTER-IP") == {"fd00::10,tcp:80", "fd00::11,udp:53"}
    assert "SWAP" not in saved


@pytest.mark.parametrize("flavour", ["nft", "legacy"])
def test_rules_load_and_read_back(make_netns: Callable[[str], Netns], flavour: str) -> None:
    ns = make_netns("ipvs")
    for family in (4, 6):
        ctx = FamilyContext(
            family=family, node=NODE, cluster_cidr=OPTIONS.cluster_cidrs[family // 6]
        )
        with ns.entered():
            Ipsets(family).ensure()
            kernel = IptablesKernel(family, flavour)
            for _ in range(2):
                kernel.write_full(RuleSet(render(ctx)), names.owned_chain)
            nat, filt = kernel.save("nat"), kernel.save("filter")
        prefix = "KNIT" if family == 4 else "KNIT6"
        assert (
            nat.count(
                f'-A PREROUTING -m comment --comment "knit ipvs services" -j {names.SERVICES}'
            )
            == 1
        )
        assert f"--match-set {prefix}-CLUSTER-IP dst,dst -j {names.MARK_MASQ}" in nat
        assert f"--match-set {prefix}-LOOP-BACK dst,dst,src -j MASQUERADE" in nat
        assert f"--match-set {prefix}-NO-ENDPOINTS dst,dst -j REJECT" in filt
        assert f"--match-set {prefix}-LOAD-BALANCER-SOURCE-CIDR dst,dst,src -j RETURN" in filt
        assert filt.count(f"-j {names.NO_ENDPOINTS}") == 2
        with ns.entered():
            assert IptablesKernel(family, flavour).remove_owned(names.owned_chain) == len(
                render(ctx).chains
            )
            assert names.CHAIN_PREFIX not in IptablesKernel(family, flavour).save("nat")


@pytest.fixture
def fake_kernel(monkeypatch: pytest.MonkeyPatch) -> FakeIpvs:
    """IPVS and the dummy link faked (this kernel has neither); sets and rules are real."""
    fake = FakeIpvs()
    bound: set[str] = set()
    monkeypatch.setattr(ipvs_proxier, "open_socket", lambda: fake)
    monkeypatch.setattr(ipvs_proxier, "ipvs_loaded", lambda: True)
    monkeypatch.setattr(dummy, "ensure", lambda: None)

    address_reads: list[int] = []

    def link_addresses(family: int) -> list[LinkAddress]:
        assert family == 4
        address_reads.append(family)
        return [
            LinkAddress(1, "127.0.0.1", 8, 254),
            LinkAddress(2, "192.0.2.10", 24, 0),
            *(LinkAddress(DUMMY_INDEX, a, 32, 0) for a in sorted(bound)),
        ]

    monkeypatch.setattr(proxier_module, "link_addresses", link_addresses)
    monkeypatch.setattr(ipvs_proxier, "link_addresses", link_addresses)
    monkeypatch.setattr(dummy, "link_index", lambda name: DUMMY_INDEX)
    fake.address_reads = address_reads  # type: ignore[attr-defined]

    def bind(added: set[str], removed: set[str]) -> None:
        bound.difference_update(removed)
        bound.update(added)

    monkeypatch.setattr(dummy, "bind", bind)
    monkeypatch.setattr(dummy, "delete", lambda: False)
    fake.bound = bound  # type: ignore[attr-defined]
    return fake


def test_proxier_syncs_sets_servers_and_rules(
    make_netns: Callable[[str], Netns], fake_kernel: FakeIpvs
) -> None:
    ns = make_netns("ipvs")
    other = ServicePortName("ns", "dns", "dns", "UDP")
    dns = ServicePort(name=other, cluster_ips=("10.96.0.53",), port=53)
    with ns.entered():
        proxier = IpvsProxier(OPTIONS, (4,), Metrics(), scheduler="lc")
        ctx = proxier.context(4, NODE)
        plans = {NAME: plan_port(PORT, (POD,), ctx), other: plan_port(dns, (), ctx)}
        assert proxier._program(ctx, plans, set(plans), full=True)
        saved = ipset_save(ns)
        rules = IptablesKernel(4, proxier.iptables[4].flavour).save("nat")
    servers = IpvsKernel(fake_kernel).services(4)
    assert set(servers) == {
        Frontend("10.96.0.10", "TCP", 80),
        Frontend("192.0.2.10", "TCP", 30080),
        Frontend("10.96.0.53", "UDP", 53),
    }
    assert {s.scheduler for s in servers.values()} == {"lc"}
    assert IpvsKernel(fake_kernel).dests(Frontend("192.0.2.10", "TCP", 30080)).keys() == {
        RealServer("10.244.1.5", 8080)
    }
    assert fake_kernel.bound == {"10.96.0.10", "10.96.0.53"}  # type: ignore[attr-defined]
    assert members(saved, "KNIT-NODE-PORT-TCP") == {"30080"}
    assert members(saved, "KNIT-NO-ENDPOINTS") == {"10.96.0.53,udp:53"}
    assert members(saved, "KNIT-IPVS-IPS") == {"10.96.0.10", "10.96.0.53"}
    assert "-A KNIT-IPVS-SERVICES ! -s 10.244.0.0/16 " in rules
    assert "--match-set KNIT-CLUSTER-IP dst,dst -j KNIT-IPVS-MARK-MASQ" in rules

    fake_kernel.log.clear()
    with ns.entered():
        plans = {NAME: plans[NAME], other: plan_port(dns, (Endpoint("10.244.1.6", 53),), ctx)}
        assert not proxier._program(ctx, plans, {other}, full=False)
        saved = ipset_save(ns)
    assert fake_kernel.writes() == [("dest", "add")]
    assert [(what, cmd) for what, cmd, _ in fake_kernel.log] == [
        ("service", "get"),
        ("dest", "add"),
    ], "only the changed virtual server is read, and no real server went: no dump"
    assert not members(saved, "KNIT-NO-ENDPOINTS")
    assert "10.244.1.6,udp:53,10.244.1.6" in members(saved, "KNIT-LOOP-BACK")

    with ns.entered():
        del plans[other]
        proxier._program(ctx, plans, {other}, full=False)
        saved = ipset_save(ns)
    assert Frontend("10.96.0.53", "UDP", 53) not in IpvsKernel(fake_kernel).services(4)
    assert fake_kernel.bound == {"10.96.0.10"}  # type: ignore[attr-defined]
    assert members(saved, "KNIT-CLUSTER-IP") == {"10.96.0.10,tcp:80"}

    with ns.entered():
        fresh = IpvsProxier(OPTIONS, (4,), Metrics())
        fresh._program(ctx, {}, set(), full=True)
    assert fake_kernel.services == {}, "a restart's full sync removes what it no longer wants"
    assert fake_kernel.bound == set()  # type: ignore[attr-defined]

    with ns.entered():
        proxier._program(ctx, plans, set(plans), full=True)
        assert fake_kernel.services
        assert fresh.cleanup() > 0
        assert "KNIT" not in ipset_save(ns)
        assert names.CHAIN_PREFIX not in IptablesKernel(4, fresh.iptables[4].flavour).save("nat")
    assert fake_kernel.services == {}, "cleanup removes the virtual servers"


def test_a_sync_reads_the_nodes_addresses_once(
    make_netns: Callable[[str], Netns], fake_kernel: FakeIpvs
) -> None:
    """A full sync with NodePort addresses chosen by CIDR and a UDP NodePort to clean up after
    needs the node's addresses three times (the CIDR's, the NodePorts' and the dummy's, the
    clean-up's): one dump gives them all; the next sync dumps afresh."""
    options = dataclasses.replace(OPTIONS, nodeport_address_cidrs=("192.0.2.0/24",))
    dns = ServicePort(
        name=ServicePortName("ns", "dns", "dns", "UDP"),
        cluster_ips=("10.96.0.53",),
        port=53,
        node_port=30053,
    )
    with make_netns("ipvs").entered():
        proxier = IpvsProxier(options, (4,), Metrics())
        proxier.sync(changes((dns, (Endpoint("10.244.1.6", 53, node_name="node-a"),))))
        assert fake_kernel.address_reads == [4]  # type: ignore[attr-defined]
        proxier.sync(changes())
        assert fake_kernel.address_reads == [4, 4]  # type: ignore[attr-defined]
    assert Frontend("192.0.2.10", "UDP", 30053) in IpvsKernel(fake_kernel).services(4)


def test_ipvs_serves_no_localhost_node_ports(make_netns: Callable[[str], Netns]) -> None:
    with make_netns("ipvs").entered():
        proxier = IpvsProxier(OPTIONS, (4,), Metrics())
        services = render(proxier.context(4, NODE)).chains[("nat", names.SERVICES)]
    assert OPTIONS.localhost_nodeports and not proxier.options.localhost_nodeports
    assert any("--dst-type LOCAL ! -d 127.0.0.0/8 -j KNIT-IPVS-NODE-PORT" in r for r in services)


@pytest.mark.skipif(HAS_IPVS, reason="checks the message on a kernel without IPVS")
def test_without_ipvs_sync_says_so_and_cleanup_still_works(
    make_netns: Callable[[str], Netns],
) -> None:
    ns = make_netns("ipvs")
    with ns.entered():
        proxier = IpvsProxier(OPTIONS, (4, 6), Metrics())
        ctx = proxier.context(4, NODE)
        with pytest.raises(ProgramError, match="IPVS is not available in this kernel"):
            proxier._program(ctx, {}, set(), full=True)
        with pytest.raises(IpvsUnavailable):
            open_socket()
        Ipsets(4).ensure()
        assert proxier.cleanup() == len(names.SETS)
        assert proxier.cleanup() == 0


HOLD = """
import socket, struct, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
f = s.makefile("rw")
print(f.readline().split()[1], flush=True)
for line in sys.stdin:
    if line.strip() == "reset":
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
        break
    f.write(line)
    f.flush()
    print(f.readline().strip(), flush=True)
"""


@pytest.fixture
def ipvs_node(make_netns: Callable[[str], Netns]) -> Iterator[tuple[Netns, Netns]]:
    """A node with a pod behind a veth, serving TCP on 8080, and the sysctls knit-proxyd sets
    in the IPVS mode (without net.ipv4.vs.conntrack, the masquerade never sees IPVS's
    connections and the node's own connections to a cluster IP get no answer)."""
    node, pod = make_netns("ipvsnode"), make_netns("ipvspod")
    for name in (*SYSCTLS_FOR_ROUTING, *ipvs_netlink.SYSCTLS):
        node.run("sysctl", "-qw", f"{name.replace('/', '.')}=1")
    node.ip("link", "add", "veth-pod", "type", "veth", "peer", "name", "eth0", "netns", pod.name)
    node.ip("addr", "add", "10.244.1.1/24", "dev", "veth-pod")
    node.ip("addr", "add", "192.0.2.10/24", "dev", "lo")
    node.ip("link", "set", "veth-pod", "up")
    pod.ip("addr", "add", "10.244.1.5/24", "dev", "eth0")
    pod.ip("link", "set", "eth0", "up")
    pod.ip("route", "add", "default", "via", "10.244.1.1")
    pod.serve("0.0.0.0", 8080, label="pod")
    yield node, pod


@needs_ipvs
def test_kernel_virtual_servers_carry_traffic_and_clean_up(ipvs_node: tuple[Netns, Netns]) -> None:
    node, _ = ipvs_node
    with node.entered():
        proxier = IpvsProxier(OPTIONS, (4,), Metrics())
        ctx = proxier.context(4, NODE)
        proxier._program(ctx, {NAME: plan_port(PORT, (POD,), ctx)}, {NAME}, full=True)
        services = IpvsKernel(open_socket()).services(4)
    assert Frontend("10.96.0.10", "TCP", 80) in services
    assert Frontend("192.0.2.10", "TCP", 30080) in services
    assert "10.96.0.10/32" in node.ip("addr", "show", "dev", names.DUMMY)
    assert node.exchange("10.96.0.10", 80)[1] == "pod"
    assert node.exchange("192.0.2.10", 30080)[1] == "pod"
    with node.entered():
        assert proxier.cleanup() > 0
        assert IpvsKernel(open_socket()).services(4) == {}
    assert names.DUMMY not in node.ip("link")


@needs_ipvs
def test_kernel_graceful_removal_waits_for_the_connection(ipvs_node: tuple[Netns, Netns]) -> None:
    node, _ = ipvs_node
    cluster = Frontend("10.96.0.10", "TCP", 80)
    with node.entered():
        proxier = IpvsProxier(OPTIONS, (4,), Metrics())
        ctx = proxier.context(4, NODE)
        proxier._program(ctx, {NAME: plan_port(PORT, (POD,), ctx)}, {NAME}, full=True)
    held = subprocess.Popen(
        ["ip", "netns", "exec", node.name, sys.executable, "-c", HOLD, "10.96.0.10", "80"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert held.stdin is not None and held.stdout is not None
    try:
        assert held.stdout.readline().strip() == "pod"
        gone = dataclasses.replace(PORT, node_port=0)
        with node.entered():
            proxier._program(ctx, {NAME: plan_port(gone, (), ctx)}, {NAME}, full=False)
            dests = IpvsKernel(open_socket()).dests(cluster)
        assert dests[RealServer("10.244.1.5", 8080)].weight == 0
        held.stdin.write("still there\n")
        held.stdin.flush()
        assert held.stdout.readline().strip() == "still there"
        held.stdin.write("reset\n")
        held.stdin.flush()
        held.wait(timeout=10)
        deadline = time.monotonic() + 60
        while True:
            with node.entered():
                proxier._program(ctx, {NAME: plan_port(gone, (), ctx)}, set(), full=False)
                dests = IpvsKernel(open_socket()).dests(cluster)
            if not dests or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert dests == {}, "the real server goes once its connection ended"
    finally:
        held.kill()
        held.wait()
        with node.entered():
            proxier.cleanup()
