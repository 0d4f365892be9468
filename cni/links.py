"""Thin helpers over pyroute2's IPRoute: look links up and turn netlink errors into CNI ones."""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError

from cni.errors import CniError, Code
from cni.result import IPInterface, IPNetwork

MAIN_TABLE = 254


@dataclass(frozen=True)
class Link:
    index: int
    name: str
    kind: str
    mac: str
    mtu: int
    master: int | None
    flags: int


@contextmanager
def netlink_errors(action: str) -> Iterator[None]:
    try:
        yield
    except NetlinkError as err:
        raise CniError(Code.NETLINK_FAILURE, f"{action}: {err}") from err


def ignoring(code: int, call: Callable[[], Any]) -> None:
    """Run a netlink call for which one errno (EEXIST, ENODEV, ...) means "already done"."""
    try:
        call()
    except NetlinkError as err:
        if err.code != code:
            raise


def link_by_name(ipr: IPRoute, name: str) -> Link | None:
    try:
        # One RTM_GETLINK by name: get_links(ifname=) dumps every link and filters in Python,
        # which costs ~0.2 ms per link on the node (8 ms with 20 pods).
        msgs = ipr.link("get", ifname=name)
    except NetlinkError as err:
        if err.code == errno.ENODEV:
            return None
        raise CniError(Code.NETLINK_FAILURE, f"cannot look up {name}: {err}") from err
    if not msgs:
        return None
    msg = msgs[0]
    info = msg.get_attr("IFLA_LINKINFO")
    return Link(
        index=msg["index"],
        name=msg.get_attr("IFLA_IFNAME"),
        kind=(info.get_attr("IFLA_INFO_KIND") if info else "") or "",
        mac=msg.get_attr("IFLA_ADDRESS") or "",
        mtu=msg.get_attr("IFLA_MTU") or 0,
        master=msg.get_attr("IFLA_MASTER"),
        flags=msg["flags"],
    )


def addresses(index: int) -> list[IPInterface]:
    """The global addresses of a link in the calling thread's network namespace, picked by the
    kernel: a dump request naming the link, on a strict-checking socket (pyroute2 filters a
    plain dump itself, after the kernel sent every link's addresses: beside an IPVS dummy
    device holding 10,000 service addresses, 590 ms against 0.4 ms here). Kernels before 4.20
    refuse strict checking: there, a plain dump, filtered below as well."""
    try:
        ipr = IPRoute(strict_check=True)
    except OSError:
        ipr = IPRoute()
    with ipr:
        dump = ipr.addr("dump", index=index, dump_filter=lambda _: True)
        return [
            ipaddress.ip_interface(f"{msg.get_attr('IFA_ADDRESS')}/{msg['prefixlen']}")
            for msg in dump
            if msg["index"] == index and msg["scope"] == 0
        ]


def routes(ipr: IPRoute, index: int, table: int) -> list[tuple[IPNetwork, str | None]]:
    """(destination, gateway) of the routes through the link in one routing table."""
    found = []
    for family, any_net in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        for msg in ipr.get_routes(family=family, table=table, oif=index):
            dst = ipaddress.ip_network(f"{msg.get_attr('RTA_DST') or any_net}/{msg['dst_len']}")
            found.append((dst, msg.get_attr("RTA_GATEWAY")))
    return found
