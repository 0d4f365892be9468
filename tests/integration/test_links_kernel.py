"""Links as cni.links looks them up and deletes them by name (rawnetlink), against pyroute2's
reading of the same links, in a namespace of its own: a bridge with a veth attached (kind, MAC,
MTU, master, flags), a link that does not exist, a name the kernel refuses, and a veth pair
removed by either end's name."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from pyroute2 import IPRoute

from cni.errors import CniError, Code
from cni.links import Link, delete_link, link_by_name
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
