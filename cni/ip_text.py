"""The one way knit reads an address or network from text it did not write (API objects,
flags, a plugin's result) for use in rule text, routes or netlink.

Python's ipaddress keeps an IPv6 scope ID with any content (`fe80::1%a\nflush ruleset`
survives `str()`), and the API server does not validate every address it stores (Node status
addresses), so such text could reach iptables-restore or nft input whole. Scope IDs are
refused, and what is returned is rebuilt from its packed bytes: its `str()` is canonical and
holds only address characters.
"""

from __future__ import annotations

import _socket
import ipaddress
from collections.abc import Iterable

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Interface = ipaddress.IPv4Interface | ipaddress.IPv6Interface


def _text(value: object, what: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not {what}")
    if "%" in value:
        raise ValueError(f"{value!r} is not {what}: knit takes no scope ID")
    return value


def address(value: object) -> Address:
    """An IP address; ValueError when `value` is not one, or has a scope ID."""
    return ipaddress.ip_address(ipaddress.ip_address(_text(value, "an IP address")).packed)


def address_text(value: object) -> str:
    """An IP address's canonical text; ValueError as `address`. Text that is already the
    canonical form of an IPv4 address (most of what the API holds) is returned as it is,
    found so by the C library's round trip (a twentieth of ipaddress's cost: a watch event
    of an EndpointSlice reads every endpoint's address)."""
    if isinstance(value, str):
        try:
            if (
                _socket.inet_ntop(_socket.AF_INET, _socket.inet_pton(_socket.AF_INET, value))
                == value
            ):
                return value
        except (OSError, ValueError):  # not IPv4 text, or holding a NUL
            pass
    return str(address(value))


def network(value: object, strict: bool = False) -> Network:
    """A network in CIDR notation, blanks around it ignored (host bits cleared unless
    `strict`); ValueError when `value` is not one, or has a scope ID."""
    parsed = ipaddress.ip_network(_text(value, "a CIDR").strip(), strict=strict)
    return ipaddress.ip_network((parsed.network_address.packed, parsed.prefixlen))


def interface(value: object) -> Interface:
    """An address with its prefix length; ValueError when `value` is not one, or has a
    scope ID."""
    parsed = ipaddress.ip_interface(_text(value, "an address with a prefix length"))
    return ipaddress.ip_interface((parsed.ip.packed, parsed.network.prefixlen))


def collapsed(networks: Iterable[Network]) -> list[Network]:
    """The networks merged where they overlap or adjoin, IPv4 first (ipaddress's
    collapse_addresses takes one family at a time)."""
    listed = list(networks)
    v4 = [network for network in listed if isinstance(network, ipaddress.IPv4Network)]
    v6 = [network for network in listed if isinstance(network, ipaddress.IPv6Network)]
    return [*ipaddress.collapse_addresses(v4), *ipaddress.collapse_addresses(v6)]
