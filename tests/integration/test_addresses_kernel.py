"""The node's addresses as cni.kernel.addresses reads them, against pyroute2's reading of the same
dump, in a namespace of its own: 1,500 addresses on a link named as IPVS mode's dummy (a
bridge: this kernel has no dummy links) make the dump span many reads; both families, prefix
lengths and scopes, the exclusion of the dummy link, the dummy's own addresses (link-local ones
left out), a point-to-point address (the local end, not the peer), one link's addresses, and an
uplink's MTU."""

from __future__ import annotations

import socket
from collections.abc import Callable

from pyroute2 import IPRoute

from cni.kernel.addresses import link_addresses
from deploy.lab.netns import Netns
from proxyd.ipvs import dummy, names
from proxyd.nodenet import kernel
from proxyd.nodenet.routes import uplink_mtu

SERVICE_ADDRESSES = [f"10.96.{i // 250}.{i % 250 + 1}" for i in range(1500)]


def test_addresses_read_in_one_dump_match_pyroute2s(make_netns: Callable[[str], Netns]) -> None:
    node = make_netns("addresses")
    node.run("ip", "link", "add", names.DUMMY, "type", "bridge")
    node.run("ip", "link", "add", "uplink", "mtu", "1400", "type", "bridge")
    for link in (names.DUMMY, "uplink"):
        node.run("ip", "link", "set", link, "up")
    batch = [f"addr add {a}/32 dev {names.DUMMY}" for a in SERVICE_ADDRESSES]
    batch += [f"addr add fd00:96::{i:x}/128 dev {names.DUMMY} nodad" for i in range(1, 4)]
    batch += [f"addr add fe80::99/64 dev {names.DUMMY} nodad"]
    batch += ["addr add 192.0.2.10/24 dev uplink", "addr add fd77::10/64 dev uplink nodad"]
    batch += ["addr add 198.51.100.1 peer 198.51.100.2 dev uplink"]
    node.run("ip", "-batch", "-", stdin="\n".join(batch) + "\n")
    with node.entered(), IPRoute() as ipr:
        for family, address_family in ((4, socket.AF_INET), (6, socket.AF_INET6)):
            seen = {
                (
                    msg["index"],
                    msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS"),
                    msg["prefixlen"],
                    msg["scope"],
                )
                for msg in ipr.get_addr(family=address_family)
            }
            assert set(link_addresses(family)) == seen
        uplink = ipr.link_lookup(ifname="uplink")[0]
        on_uplink = {
            (msg["index"], msg.get("IFA_LOCAL") or msg.get("IFA_ADDRESS"), msg["prefixlen"])
            for msg in ipr.get_addr(index=uplink)
        }
        assert {a[:3] for a in link_addresses(index=uplink)} == on_uplink
        assert (uplink, "198.51.100.1", 32) in on_uplink
        v4, v6 = (dummy.node_addresses(link_addresses(family)) for family in (4, 6))
        assert v4.elsewhere == ("127.0.0.1", "192.0.2.10", "198.51.100.1")
        assert len(link_addresses(4)) == len(SERVICE_ADDRESSES) + 3
        assert {a for a in v6.elsewhere if not a.startswith("fe80:")} == {"::1", "fd77::10"}
        assert v4.bound == set(SERVICE_ADDRESSES)
        assert v6.bound == {"fd00:96::1", "fd00:96::2", "fd00:96::3"}
        with kernel.route_socket() as sock:
            assert uplink_mtu(sock, "192.0.2.10") == 1400
            assert uplink_mtu(sock, "fd77::10") == 1400


def test_without_the_dummy_link_it_has_no_addresses(make_netns: Callable[[str], Netns]) -> None:
    with make_netns("addresses").entered():
        no_link = dummy.NodeAddresses(frozenset(), ("127.0.0.1",))
        assert dummy.node_addresses(link_addresses(4)) == no_link
