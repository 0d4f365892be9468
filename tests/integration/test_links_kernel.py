"""Links as cni.links looks them up and deletes them by name (rawnetlink), against pyroute2's
reading of the same links, in a namespace of its own: a bridge with a veth attached (kind, MAC,
MTU, master, flags), a link that does not exist, a name the kernel refuses, and a veth pair
removed by either end's name. Then what cni.links and cni.routes write, as `ip` reads it back:
a bridge, a veth pair across namespaces, flags, a master, hairpin, addresses and routes with
the CNI 1.1 extras."""

from __future__ import annotations

import errno
import ipaddress
import json
import os
from collections.abc import Callable
from typing import Any

import pytest
from pyroute2 import IPRoute

from cni import links
from cni.errors import CniError, Code
from cni.kernel.netns import open_netns
from cni.kernel.rawnetlink import RawNetlinkError
from cni.links import Link, delete_link, link_by_name
from cni.result import Route
from cni.routes import add_route, routes
from deploy.lab.netns import Netns


def test_a_link_read_by_name_matches_pyroute2s(make_netns: Callable[[str], Netns]) -> None:
    node = make_netns("links")
    node.run("ip", "link", "add", "kbr0", "mtu", "1450", "type", "bridge")
    node.run("ip", "link", "add", "kveth0", "mtu", "1450", "type", "veth", "peer", "name", "kveth1")
    node.run("ip", "link", "set", "kveth0", "master", "kbr0", "up")
    with node.entered(), IPRoute() as ipr:
        for name in ("kbr0", "kveth0", "kveth1", "lo"):
            (msg,) = ipr.link("get", ifname=name)
            info = msg.get_attr("IFLA_LINKINFO")
            assert link_by_name(name) == Link(
                index=msg["index"],
                name=name,
                kind=(info.get_attr("IFLA_INFO_KIND") if info else "") or "",
                mac=msg.get_attr("IFLA_ADDRESS") or "",
                mtu=msg.get_attr("IFLA_MTU"),
                master=msg.get_attr("IFLA_MASTER"),
                flags=msg["flags"],
            )
        bridge, veth = link_by_name("kbr0"), link_by_name("kveth0")
        assert bridge is not None and veth is not None
        assert (bridge.kind, bridge.mtu, veth.kind, veth.master) == (
            "bridge",
            1450,
            "veth",
            bridge.index,
        )
        assert link_by_name("absent0") is None
        with pytest.raises(CniError) as refused:
            link_by_name("x" * 20)
        assert refused.value.code == Code.NETLINK_FAILURE


def test_a_veth_pair_is_deleted_by_either_ends_name(make_netns: Callable[[str], Netns]) -> None:
    node = make_netns("links")
    node.run("ip", "link", "add", "kveth0", "type", "veth", "peer", "name", "kveth1")
    with node.entered():
        assert delete_link("kveth1") is True
        assert link_by_name("kveth0") is None, "the other end went with it"
        assert delete_link("kveth0") is False


def details(ns: Netns, name: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(ns.run("ip", "-d", "-j", "address", "show", name).stdout)[0]
    return found


def test_written_links_are_what_ip_reads(make_netns: Callable[[str], Netns]) -> None:
    node, pod = make_netns("links"), make_netns("links-pod")
    pod_fd = open_netns(pod.path)
    try:
        with node.entered():
            links.create_bridge("kbr0", vlan_filtering=False)
            links.create_veth("kveth0", "eth0", pod_fd, 1400, "0a:58:0a:f4:01:05")
            with pytest.raises(RawNetlinkError) as exists:
                links.create_veth("kveth0", "eth1", pod_fd, 0, "")
            assert exists.value.errno == errno.EEXIST
            bridge, host = link_by_name("kbr0"), link_by_name("kveth0")
            assert bridge is not None and host is not None
            links.set_link(bridge.index, up=True, promisc=True, mtu=1400)
            links.set_link(host.index, up=True, master=bridge.index)
            links.set_hairpin(host.index)
            gateway = ipaddress.ip_interface("10.244.1.1/24")
            links.add_address(bridge.index, gateway)
            links.add_address(bridge.index, ipaddress.ip_interface("fd00:10:244:1::1/64"))
            links.delete_address(bridge.index, ipaddress.ip_interface("fd00:10:244:1::1/64"))
    finally:
        os.close(pod_fd)
    bridge_seen, host_seen = details(node, "kbr0"), details(node, "kveth0")
    assert {"UP", "PROMISC"} <= set(bridge_seen["flags"]) and bridge_seen["mtu"] == 1400
    global_addresses = [a for a in bridge_seen["addr_info"] if a["scope"] == "global"]
    assert [(a["local"], a["prefixlen"]) for a in global_addresses] == [("10.244.1.1", 24)]
    assert host_seen["master"] == "kbr0" and "UP" in host_seen["flags"]
    assert host_seen["linkinfo"]["info_slave_data"]["hairpin"] is True
    pod_seen = details(pod, "eth0")
    assert (pod_seen["mtu"], pod_seen["address"]) == (1400, "0a:58:0a:f4:01:05")
    assert pod_seen["linkinfo"]["info_kind"] == "veth"


def test_routes_carry_their_extras_and_are_read_per_table(
    make_netns: Callable[[str], Netns],
) -> None:
    pod = make_netns("routes")
    pod.run("ip", "link", "add", "eth0", "type", "veth", "peer", "name", "peer0")
    pod.run("ip", "link", "set", "eth0", "up")
    pod.run("ip", "link", "set", "peer0", "up")
    pod.run("ip", "address", "add", "10.244.1.5/24", "dev", "eth0")
    pod.run("ip", "address", "add", "fd00::5/64", "dev", "eth0", "nodad")
    network = ipaddress.ip_network
    gateway4, gateway6 = ipaddress.ip_address("10.244.1.1"), ipaddress.ip_address("fd00::1")
    with pod.entered():
        eth0 = link_by_name("eth0")
        assert eth0 is not None
        add_route(Route(network("0.0.0.0/0"), gateway4, {"mtu": 1400, "advmss": 1360}), eth0.index)
        add_route(Route(network("10.99.0.0/16"), gateway4, {"table": 100}), eth0.index)
        add_route(Route(network("10.98.0.0/16"), None, {"priority": 7, "scope": 253}), eth0.index)
        add_route(Route(network("fd01::/64"), gateway6, {"table": 1000}), eth0.index)
        with pytest.raises(RawNetlinkError) as exists:
            add_route(Route(network("10.98.0.0/16"), None, {"priority": 7}), eth0.index)
        assert exists.value.errno == errno.EEXIST
        assert set(routes(eth0.index, 254)) >= {
            (network("0.0.0.0/0"), "10.244.1.1"),
            (network("10.98.0.0/16"), None),
            (network("10.244.1.0/24"), None),
        }
        assert routes(eth0.index, 100) == [(network("10.99.0.0/16"), "10.244.1.1")]
        assert routes(eth0.index, 1000) == [(network("fd01::/64"), "fd00::1")]
    main = pod.run("ip", "route", "show", "dev", "eth0").stdout
    assert "default via 10.244.1.1 proto static mtu 1400 advmss 1360" in main
    assert "10.98.0.0/16 proto static scope link metric 7" in main
