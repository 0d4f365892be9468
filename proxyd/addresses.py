"""The node's own addresses, read through netlink."""

from __future__ import annotations

import ipaddress
import socket

from pyroute2 import IPRoute

from proxyd.model import NodeInfo, family_of

ADDRESS_FAMILIES = {4: socket.AF_INET, 6: socket.AF_INET6}


def local_addresses(family: int, exclude_ifname: str | None = None) -> list[str]:
    """The family's addresses of every link (but `exclude_ifname`'s)."""
    with IPRoute() as ipr:
        excluded = ipr.link_lookup(ifname=exclude_ifname) if exclude_ifname else []
        return sorted(
            {
                msg.get("IFA_ADDRESS")
                for msg in ipr.get_addr(family=ADDRESS_FAMILIES[family])
                if msg["index"] not in excluded
            }
            - {None}
        )


def nodeport_addresses(
    selectors: tuple[str, ...], family: int, node: NodeInfo
) -> tuple[str, ...] | None:
    """The addresses of this family that --nodeport-addresses selects: local addresses inside
    the given CIDRs, and the node's primary address (its first InternalIP of the family, else
    its first ExternalIP) for `primary`. None (every local address) when nothing in the flag
    speaks for this family, as kube-proxy reads it."""
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
        for address in local_addresses(family):
            if any(ipaddress.ip_address(address) in net for net in networks):
                chosen.add(address)
    return tuple(sorted(chosen))
