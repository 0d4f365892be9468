"""The UDP conntrack clean-up against the kernel's table, in a namespace of its own, for each IP
family: entries made through pyroute2 (another reading of ctnetlink than the clean-up's), then
cleared with a dump per frontend port (the kernel filters) and with one dump of every UDP entry
(past FILTERED_DUMPS_UP_TO ports); both delete the same, stale, entries, one of them in another
conntrack zone. And the deletion of a new pod's address's entries (policy admission)."""

from __future__ import annotations

import errno
import socket
from collections.abc import Callable
from typing import Any

import pytest
from pyroute2 import Conntrack
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

from cni.kernel.rawnetlink import NETLINK_NETFILTER, NetlinkSocket, RawNetlinkError
from deploy.lab.conntrack_entries import add_entry
from deploy.lab.netns import Netns
from proxyd import conntrack
from proxyd.conntrack import Frontends, clear_stale

NODE_PORT = 30053
ADDRESSES = {
    4: {
        "cluster_ip": "10.96.0.10",
        "node": "10.77.1.11",
        "elsewhere": "10.77.1.99",
        "endpoint": "10.244.1.5",
        "gone": "10.244.1.6",
        "client": "10.1.0.",
    },
    6: {
        "cluster_ip": "fd00:96::10",
        "node": "fd77:1::11",
        "elsewhere": "fd77:1::99",
        "endpoint": "fd10:244:1::5",
        "gone": "fd10:244:1::6",
        "client": "fd01::",
    },
}


def remaining(ct: Conntrack, family: int) -> set[tuple[str, str, int]]:
    """(client, destination address, port) of every UDP entry left."""
    udp = NFCTAttrTuple(family=family, proto=socket.IPPROTO_UDP)
    return {
        (e.tuple_orig.saddr, e.tuple_orig.daddr, e.tuple_orig.dport)
        for e in ct.dump_entries(tuple_orig=udp)
    }


@pytest.mark.parametrize("version", [4, 6], ids=["IPv4", "IPv6"])
@pytest.mark.parametrize("filtered", [True, False], ids=["dump-per-frontend", "one-dump"])
def test_stale_udp_entries_of_the_frontends_go_and_the_rest_stay(
    make_netns: Callable[[str], Netns],
    monkeypatch: pytest.MonkeyPatch,
    filtered: bool,
    version: int,
) -> None:
    if not filtered:
        monkeypatch.setattr(conntrack, "FILTERED_DUMPS_UP_TO", 0)
    at = ADDRESSES[version]
    family = socket.AF_INET if version == 4 else socket.AF_INET6
    client = [f"{at['client']}{i}" for i in range(1, 8)]
    node = make_netns("conntrack")
    frontends = Frontends(
        version,
        by_address={(at["cluster_ip"], 53): {(at["endpoint"], 53)}},
        by_node_port={NODE_PORT: {(at["endpoint"], 53)}},
        local_addresses={at["node"]},
    )
    per_port = filtered and conntrack.kernel_filters_dumps()
    expected_ports = [53, NODE_PORT] if per_port else [None]
    assert frontends.dump_ports(lambda: 7) == expected_ports
    assert frontends.dump_ports(lambda: conntrack.KERNEL_WALK_BUDGET) == [None]
    one_port = Frontends(version, by_address=frontends.by_address)
    assert one_port.dump_ports(lambda: conntrack.KERNEL_WALK_BUDGET + 1) == (
        [53] if per_port else [None]
    ), "one port's dump walks the table as the family's would"
    dumped: list[int | None] = []
    every_entry = conntrack.entries

    def recorded(*args: Any) -> list[conntrack.Entry]:
        dumped.append(args[2])
        return every_entry(*args)

    monkeypatch.setattr(conntrack, "entries", recorded)
    with node.entered(), Conntrack(nfgen_family=family) as ct:
        add_entry(ct, family, client[0], (at["cluster_ip"], 53), at["endpoint"])
        add_entry(ct, family, client[1], (at["cluster_ip"], 53), at["gone"])
        add_entry(ct, family, client[2], (at["cluster_ip"], 5353), at["gone"])
        add_entry(ct, family, client[3], (at["node"], NODE_PORT), at["gone"])
        add_entry(ct, family, client[4], (at["elsewhere"], NODE_PORT), at["gone"])
        add_entry(ct, family, client[5], (at["node"], NODE_PORT), at["endpoint"])
        add_entry(ct, family, client[6], (at["cluster_ip"], 53), at["gone"], zone=7)
        assert clear_stale(frontends) == 3
        assert dumped == expected_ports
        assert remaining(ct, family) == {
            (client[0], at["cluster_ip"], 53),
            (client[2], at["cluster_ip"], 5353),
            (client[4], at["elsewhere"], NODE_PORT),
            (client[5], at["node"], NODE_PORT),
        }


def test_the_kernel_returns_one_ports_udp_entries_of_the_family_and_deletes_one_once(
    make_netns: Callable[[str], Netns],
) -> None:
    node = make_netns("conntrack")
    with node.entered(), Conntrack() as ct, NetlinkSocket(NETLINK_NETFILTER) as sock:
        add_entry(ct, socket.AF_INET, "10.1.0.1", ("10.96.0.10", 53), "10.244.1.6")
        add_entry(ct, socket.AF_INET, "10.1.0.2", ("10.96.0.10", 5353), "10.244.1.6")
        tcp = socket.IPPROTO_TCP
        add_entry(ct, socket.AF_INET, "10.1.0.3", ("10.96.0.10", 53), "10.244.1.6", proto=tcp)
        with Conntrack(nfgen_family=socket.AF_INET6) as ct6:
            add_entry(ct6, socket.AF_INET6, "fd01::1", ("fd00:96::10", 53), "fd10:244:1::6")
        assert conntrack.table_size(sock) == 4
        sent = sock.dump(
            conntrack.MSG_GET, conntrack.dump_request(socket.AF_INET, 53), lambda *message: True
        )
        assert len(sent) == (1 if conntrack.kernel_filters_dumps() else 3)  # the family's
        every_port = conntrack.entries(sock, socket.AF_INET, None, lambda *_: True)
        assert {entry.destination for entry in every_port} == {
            ("10.96.0.10", 53),
            ("10.96.0.10", 5353),
        }
        to_53 = conntrack.entries(sock, socket.AF_INET, 53, lambda to, _: to[1] == 53)
        [entry] = to_53  # a kernel before 5.8 returns the other port's too, left out here
        assert entry.destination == ("10.96.0.10", 53)
        assert entry.reply_source == ("10.244.1.6", 53)
        sock.request(conntrack.MSG_DELETE, entry.delete_request)
        assert conntrack.table_size(sock) == 3
        with pytest.raises(RawNetlinkError) as refused:
            sock.request(conntrack.MSG_DELETE, entry.delete_request)
        assert refused.value.errno == errno.ENOENT


@pytest.mark.parametrize("version", [4, 6], ids=["IPv4", "IPv6"])
def test_a_new_pod_address_loses_every_entry_from_or_to_it_and_no_other(
    make_netns: Callable[[str], Netns], version: int
) -> None:
    at = ADDRESSES[version]
    family = socket.AF_INET if version == 4 else socket.AF_INET6
    other = socket.AF_INET6 if version == 4 else socket.AF_INET
    client = [f"{at['client']}{i}" for i in range(1, 5)]
    pod, tcp = at["endpoint"], socket.IPPROTO_TCP
    node = make_netns("conntrack")
    with node.entered(), Conntrack(nfgen_family=family) as ct:
        add_entry(ct, family, client[0], (pod, 53), pod)  # to the pod
        add_entry(ct, family, client[1], (at["cluster_ip"], 53), pod, proto=tcp)  # DNATed to it
        add_entry(ct, family, pod, (client[2], 53), client[2])  # from the pod
        add_entry(ct, family, client[3], (at["cluster_ip"], 53), at["gone"])  # elsewhere
        with Conntrack(nfgen_family=other) as ct_other:
            twin = ADDRESSES[6 if version == 4 else 4]
            add_entry(
                ct_other, other, f"{twin['client']}1", (twin["endpoint"], 53), twin["endpoint"]
            )
            assert conntrack.forget_addresses([pod]) == 3
            assert conntrack.forget_addresses([pod]) == 0
            assert len(list(ct_other.dump_entries())) == 1, "the other family's stays"
            assert conntrack.forget_addresses([pod, twin["endpoint"]]) == 1, "both families"
        assert remaining(ct, family) == {(client[3], at["cluster_ip"], 53)}
        assert not list(ct.dump_entries(tuple_orig=NFCTAttrTuple(family=family, proto=tcp)))


@pytest.mark.parametrize("version", [4, 6], ids=["IPv4", "IPv6"])
def test_never_answered_tcp_and_sctp_entries_no_endpoint_serves_go_and_no_other(
    make_netns: Callable[[str], Netns], version: int
) -> None:
    """An attempt that got no answer, sent before the frontend's rules were written (not
    DNATed) or to an endpoint since gone, leaves an entry that a later attempt from the same
    source port would follow: it goes; what was answered, or DNATed to a serving endpoint
    (its SYN-ACK on the way), stays."""
    at = ADDRESSES[version]
    family = socket.AF_INET if version == 4 else socket.AF_INET6
    cluster_ip, endpoint, gone = at["cluster_ip"], at["endpoint"], at["gone"]
    client = [f"{at['client']}{i}" for i in range(1, 9)]
    tcp, sctp, udp = socket.IPPROTO_TCP, socket.IPPROTO_SCTP, socket.IPPROTO_UDP
    node = make_netns("conntrack")
    with node.entered(), Conntrack(nfgen_family=family) as ct:
        for who, proto, reply_from, reply_port, answered in [
            (client[0], tcp, cluster_ip, 80, False),  # goes: not DNATed
            (client[1], sctp, cluster_ip, 80, False),  # goes
            (client[2], tcp, gone, 8080, False),  # goes: DNATed to an endpoint since gone
            (client[3], tcp, cluster_ip, 80, True),  # answered: a host owns the address
            (client[4], tcp, gone, 8080, True),  # answered: a connection left to end
            (client[5], tcp, endpoint, 8080, False),  # DNATed to a serving endpoint
            (client[6], udp, cluster_ip, 80, False),  # UDP: the stale clean-up's
        ]:
            add_entry(ct, family, who, (cluster_ip, 80), reply_from, 0, proto, reply_port, answered)
        add_entry(ct, family, client[7], (cluster_ip, 81), cluster_ip, proto=tcp, reply_port=81)
        with NetlinkSocket(NETLINK_NETFILTER) as sock:
            read = conntrack.entries(sock, family, 80, lambda *_: True, tcp, unanswered=True)
        assert {e.reply_source for e in read} == {(cluster_ip, 80), (gone, 8080), (endpoint, 8080)}
        serving = {(cluster_ip, 80): {(endpoint, 8080)}}
        frontends = {
            tcp: Frontends(version, by_address=serving),
            sctp: Frontends(version, by_address=serving),
        }
        assert conntrack.clear_unanswered(frontends) == 3
        left = {(e.tuple_orig.saddr, e.tuple_orig.dport) for e in ct.dump_entries()}
        kept = {(client[i], 80) for i in (3, 4, 5, 6)}
        assert left == {*kept, (client[7], 81)}
