"""The node's own addresses, read through netlink."""

from __future__ import annotations

import ipaddress
import socket

from pyroute2 import IPRoute

from proxyd.model import NodeInfo


def local_addresses(family: int) -> list[str]:
    af = socket.AF_INET if family == 4 else socket.AF_INET6
    with IPRoute() as ipr:
        return sorted({msg.get("IFA_ADDRESS") for msg in ipr.get_addr(family=af)} - {None})


def nodeport_addresses(selectors: tuple[str, ...], family: int, node: NodeInfo) -> tuple[str, ...]:
    """The addresses of this family that --nodeport-addresses selects: local addresses inside
    the given CIDRs, and the node's primary (InternalIP) address for `primary`."""
    chosen: set[str] = set()
    networks = [
        ipaddress.ip_network(s, strict=False)
        for s in selectors
        if s != "primary" and ipaddress.ip_network(s, strict=False).version == family
    ]
    if networks:
        for address in local_addresses(family):
            if any(ipaddress.ip_address(address) in net for net in networks):
                chosen.add(address)
    if "primary" in selectors:
        chosen.update(a for a in node.addresses if ipaddress.ip_address(a).version == family)
    return tuple(sorted(chosen))
