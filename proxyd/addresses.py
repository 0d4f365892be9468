"""The daemon's side of the node's own addresses (cni.kernel.addresses reads them): a link's
index by name, and the addresses --nodeport-addresses selects."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable

from cni.kernel.addresses import LinkAddress
from proxyd.model import NodeInfo, family_of


def link_index(name: str) -> int | None:
    """The index of the link called name; None when there is none."""
    try:
        return socket.if_nametoindex(name)
    except OSError:
        return None


def nodeport_addresses(
    selectors: tuple[str, ...],
    family: int,
    node: NodeInfo,
    local: Callable[[], Iterable[LinkAddress]],
) -> tuple[str, ...] | None:
    """The addresses of this family that --nodeport-addresses selects: local addresses inside
    the given CIDRs (`local()`: cni.kernel.addresses.link_addresses' answer, asked only for CIDRs),
    and the node's primary address (its first InternalIP of the family, else its first
    ExternalIP) for `primary`. None (every local address) when nothing in the flag speaks for
    this family, as kube-proxy reads it."""
    networks = [
        ipaddress.ip_network(s, strict=False)
        for s in selectors
        if s != "primary" and family_of(s) == family
    ]
    of_family = (a for a in node.addresses if family_of(a) == family)
    primary = next(of_family, None) if "primary" in selectors else None
    if not networks and primary is None:
        return None
    chosen = {primary} if primary is not None else set()
    if networks:
        for on_link in local():
            if any(ipaddress.ip_address(on_link.address) in net for net in networks):
                chosen.add(on_link.address)
    return tuple(sorted(chosen))
