"""The IPVS netlink messages knit builds, and the virtual/real server diff with graceful
removal, against a fake IPVS table (this machine's kernel has no IPVS): it keeps what each
request says after pyroute2's message classes encoded it to bytes and decoded it again, a
model of the kernel's tables, not the kernel's own parsing."""

from __future__ import annotations

import socket
import struct

import pytest
from pyroute2.netlink.generic import ipvs as genl

from proxyd.ipvs.desired import Frontend, RealServer, VirtualServer
from proxyd.ipvs.netlink import IpvsKernel, dest_request, service_request
from proxyd.ipvs.servers import ServerSync
from tests.support.ipvs_doubles import FakeIpvs, attrs_of, wire

CLUSTER = Frontend("10.96.0.10", "TCP", 80)
A = RealServer("10.244.1.5", 8080)
B = RealServer("10.244.2.5", 8080)


def vs(frontend: Frontend, *reals: RealServer, scheduler: str = "rr", timeout: int = 0):
    return VirtualServer(frontend, scheduler, timeout, frozenset(reals))


def test_service_message_carries_scheduler_persistence_and_netmask() -> None:
    msg = wire(
        genl.IPVS_CMD_NEW_SERVICE,
        [("IPVS_CMD_ATTR_SERVICE", service_request(vs(CLUSTER, timeout=30)).dump_nla())],
    )
    svc = attrs_of(msg.get("IPVS_CMD_ATTR_SERVICE"))
    assert svc["IPVS_SVC_ATTR_AF"] == socket.AF_INET
    assert svc["IPVS_SVC_ATTR_ADDR"] == "10.96.0.10"
    assert svc["IPVS_SVC_ATTR_PORT"] == 80
    assert svc["IPVS_SVC_ATTR_PROTOCOL"] == socket.IPPROTO_TCP
    assert svc["IPVS_SVC_ATTR_SCHED_NAME"] == "rr"
    assert svc["IPVS_SVC_ATTR_TIMEOUT"] == 30
    assert svc["IPVS_SVC_ATTR_FLAGS"]["flags"] == 1
    assert svc["IPVS_SVC_ATTR_NETMASK"] == "255.255.255.255"
    plain = service_request(vs(CLUSTER, scheduler="sh")).dump_nla()
    assert attrs_of(plain)["IPVS_SVC_ATTR_FLAGS"]["flags"] == 0
    assert attrs_of(plain)["IPVS_SVC_ATTR_SCHED_NAME"] == "sh"


def test_ipv6_sctp_service_packs_the_prefix_length_as_a_host_order_u32() -> None:
    frontend = Frontend("fd00::10", "SCTP", 80)
    raw = service_request(vs(frontend)).dump_nla()
    msg = wire(genl.IPVS_CMD_NEW_SERVICE, [("IPVS_CMD_ATTR_SERVICE", raw)])
    svc = attrs_of(msg.get("IPVS_CMD_ATTR_SERVICE"))
    assert svc["IPVS_SVC_ATTR_AF"] == socket.AF_INET6
    assert svc["IPVS_SVC_ATTR_ADDR"] == "fd00::10"
    assert svc["IPVS_SVC_ATTR_PROTOCOL"] == 132
    assert struct.unpack("=I", socket.inet_aton(svc["IPVS_SVC_ATTR_NETMASK"]))[0] == 128


def test_real_server_message_uses_masquerading_and_the_weight() -> None:
    for real, family in ((A, socket.AF_INET), (RealServer("fd10::5", 8080), socket.AF_INET6)):
        msg = wire(
            genl.IPVS_CMD_NEW_DEST, [("IPVS_CMD_ATTR_DEST", dest_request(real, 1).dump_nla())]
        )
        dest = attrs_of(msg.get("IPVS_CMD_ATTR_DEST"))
        assert dest["IPVS_DEST_ATTR_ADDR"] == real.ip
        assert dest["IPVS_DEST_ATTR_ADDR_FAMILY"] == family
        assert dest["IPVS_DEST_ATTR_PORT"] == 8080
        assert dest["IPVS_DEST_ATTR_FWD_METHOD"] == 0, "NAT (masquerading), not direct routing"
        assert dest["IPVS_DEST_ATTR_WEIGHT"] == 1


def test_kernel_reads_back_what_it_wrote() -> None:
    fake = FakeIpvs()
    kernel = IpvsKernel(fake)
    kernel.add_service(vs(CLUSTER, timeout=60))
    kernel.add_dest(CLUSTER, A, 1)
    services = kernel.services(4)
    assert services[CLUSTER].scheduler == "rr" and services[CLUSTER].timeout == 60
    assert kernel.services(6) == {}
    assert kernel.service(CLUSTER) == services[CLUSTER]
    assert kernel.service(Frontend("10.96.0.11", "TCP", 80)) is None
    fake.connections[("10.244.1.5", 8080)] = (2, 1)
    info = kernel.dests(CLUSTER)[A]
    assert (info.weight, info.active, info.inactive) == (1, 2, 1)


def full(sync: ServerSync, wanted: dict[Frontend, VirtualServer]) -> None:
    """A full sync as the proxier runs it: the kernel's virtual servers read once, and every
    wanted and existing one programmed with nothing known of what was wanted before."""
    existing = sync.kernel.services(sync.family)
    sync.apply(dict.fromkeys(wanted.keys() | existing.keys()), wanted.get, existing)


def test_sync_adds_then_changes_only_what_differs() -> None:
    fake = FakeIpvs()
    sync = ServerSync(IpvsKernel(fake), 4)
    wanted = {CLUSTER: vs(CLUSTER, A)}
    full(sync, wanted)
    assert fake.writes() == [("service", "add"), ("dest", "add")]
    fake.log.clear()
    grown = {CLUSTER: vs(CLUSTER, A, B)}
    sync.apply(wanted, grown.get)
    assert fake.writes() == [("dest", "add")]
    assert not fake.dumped_dests(), "no real server went, so none is read"
    assert fake.weights("10.96.0.10", 80) == {("10.244.1.5", 8080): 1, ("10.244.2.5", 8080): 1}
    fake.log.clear()
    sync.apply(grown, grown.get)
    assert fake.writes() == []
    changed = {CLUSTER: vs(CLUSTER, A, B, scheduler="lc")}
    sync.apply(grown, changed.get)
    assert fake.writes() == [("service", "set")]


def test_removed_tcp_real_server_drains_at_weight_zero_then_goes() -> None:
    fake = FakeIpvs()
    sync = ServerSync(IpvsKernel(fake), 4)
    before = {CLUSTER: vs(CLUSTER, A, B)}
    full(sync, before)
    fake.connections[("10.244.2.5", 8080)] = (1, 0)
    wanted = {CLUSTER: vs(CLUSTER, A)}
    sync.apply(before, wanted.get)
    assert fake.weights("10.96.0.10", 80) == {("10.244.1.5", 8080): 1, ("10.244.2.5", 8080): 0}
    sync.apply({}, wanted.get)
    assert ("10.244.2.5", 8080) in fake.weights("10.96.0.10", 80), "still has a connection"
    fake.connections[("10.244.2.5", 8080)] = (0, 1)
    sync.apply({}, wanted.get)
    assert ("10.244.2.5", 8080) in fake.weights("10.96.0.10", 80), "inactive ones count too"
    fake.connections[("10.244.2.5", 8080)] = (0, 0)
    fake.log.clear()
    sync.apply({}, wanted.get)
    assert fake.weights("10.96.0.10", 80) == {("10.244.1.5", 8080): 1}
    assert fake.writes() == [("dest", "del")]
    assert not sync.terminating


def test_a_draining_real_server_that_comes_back_gets_its_weight_again() -> None:
    fake = FakeIpvs()
    sync = ServerSync(IpvsKernel(fake), 4)
    full(sync, {CLUSTER: vs(CLUSTER, A, B)})
    fake.connections[("10.244.2.5", 8080)] = (3, 0)
    sync.apply({CLUSTER: vs(CLUSTER, A, B)}, {CLUSTER: vs(CLUSTER, A)}.get)
    assert sync.terminating == {CLUSTER: {B}}
    fake.log.clear()
    sync.apply({CLUSTER: vs(CLUSTER, A)}, {CLUSTER: vs(CLUSTER, A, B)}.get)
    assert fake.weights("10.96.0.10", 80)[("10.244.2.5", 8080)] == 1
    assert fake.writes() == [("dest", "set")] and not fake.dumped_dests()
    assert not sync.terminating


def test_idle_tcp_and_any_udp_or_sctp_real_server_go_at_once() -> None:
    fake = FakeIpvs()
    sync = ServerSync(IpvsKernel(fake), 4)
    udp = Frontend("10.96.0.10", "UDP", 53)
    sctp = Frontend("10.96.0.10", "SCTP", 9)
    before = {CLUSTER: vs(CLUSTER, A, B), udp: vs(udp, A, B), sctp: vs(sctp, A, B)}
    full(sync, before)
    fake.connections[("10.244.1.5", 8080)] = (5, 5)
    sync.apply(before, {CLUSTER: vs(CLUSTER, B), udp: vs(udp, B), sctp: vs(sctp, B)}.get)
    assert fake.weights("10.96.0.10", 53, socket.IPPROTO_UDP) == {("10.244.2.5", 8080): 1}
    assert fake.weights("10.96.0.10", 9, 132) == {("10.244.2.5", 8080): 1}
    assert fake.weights("10.96.0.10", 80)[("10.244.1.5", 8080)] == 0
    fake.connections.clear()
    sync.apply({CLUSTER: vs(CLUSTER, B)}, {CLUSTER: vs(CLUSTER)}.get)
    assert fake.weights("10.96.0.10", 80) == {}


def test_unwanted_virtual_servers_are_deleted_whole() -> None:
    fake = FakeIpvs()
    sync = ServerSync(IpvsKernel(fake), 4)
    full(sync, {CLUSTER: vs(CLUSTER, A)})
    fake.connections[("10.244.1.5", 8080)] = (1, 0)
    sync.apply({CLUSTER: vs(CLUSTER, A)}, {CLUSTER: vs(CLUSTER)}.get)
    assert sync.terminating
    full(sync, {})
    assert fake.services == {} and not sync.terminating


@pytest.mark.parametrize("family", [4, 6])
def test_services_of_the_other_family_are_left_alone(family: int) -> None:
    fake = FakeIpvs()
    kernel = IpvsKernel(fake)
    v4, v6 = CLUSTER, Frontend("fd00::10", "TCP", 80)
    kernel.add_service(vs(v4))
    kernel.add_service(vs(v6))
    full(ServerSync(kernel, family), {})
    other = v6 if family == 4 else v4
    assert [address for _, address, _, _ in fake.services] == [other.address]
