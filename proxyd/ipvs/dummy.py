"""Thin layer over the dummy link knit-ipvs0 (pyroute2): IPVS answers only for local
addresses, so every cluster, external and load balancer IP is bound to it (as a /32 or
/128, IPv6 without duplicate address detection); the link is up so IPv6 addresses work."""

from __future__ import annotations

import errno
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from pyroute2 import IPRoute
from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.rtnl.ifaddrmsg import IFA_F_NODAD

from cni.kernel.addresses import LinkAddress
from proxyd.addresses import link_index
from proxyd.ipvs.names import DUMMY
from proxyd.model import family_of


def ensure() -> None:
    """Create the link (up) unless it exists."""
    with IPRoute() as ipr:
        index = link_index(DUMMY)
        if index is None:
            ipr.link("add", ifname=DUMMY, kind="dummy")
            index = link_index(DUMMY)
        ipr.link("set", index=index, state="up")


@dataclass(frozen=True, slots=True)
class NodeAddresses:
    """The node's addresses of one family, from one dump, split at the link."""

    bound: frozenset[str]
    """The link's own (link-local ones left out); empty when the link does not exist."""
    elsewhere: tuple[str, ...]
    """Every other link's, sorted."""


def node_addresses(on_links: Iterable[LinkAddress]) -> NodeAddresses:
    """`on_links` (cni.kernel.addresses.link_addresses' answer) split at the link."""
    index = link_index(DUMMY)
    bound: set[str] = set()
    elsewhere: set[str] = set()
    for link, address, _, _ in on_links:
        if link != index:
            elsewhere.add(address)
        elif not address.startswith("fe80:"):
            bound.add(address)
    return NodeAddresses(frozenset(bound), tuple(sorted(elsewhere)))


def _prefix(address: str) -> int:
    return 128 if family_of(address) == 6 else 32


def bind(added: AbstractSet[str], removed: AbstractSet[str]) -> None:
    """Add and remove addresses; adding one twice or removing a missing one is no error."""
    if not added and not removed:
        return
    index = link_index(DUMMY)
    with IPRoute() as ipr:
        for address in sorted(removed):
            try:
                ipr.addr("del", index=index, address=address, prefixlen=_prefix(address))
            except NetlinkError as err:
                if err.code != errno.EADDRNOTAVAIL:
                    raise
        for address in sorted(added):
            flags = IFA_F_NODAD if family_of(address) == 6 else 0
            ipr.addr(
                "replace", index=index, address=address, prefixlen=_prefix(address), flags=flags
            )


def delete() -> bool:
    """Remove the link (and so its addresses); False when there was none."""
    index = link_index(DUMMY)
    if index is None:
        return False
    with IPRoute() as ipr:
        ipr.link("del", index=index)
    return True
