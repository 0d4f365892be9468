"""UDP conntrack cleanup through netlink (pyroute2).

UDP has no connection end, so a client keeps sending to an endpoint that is gone for as long
as its conntrack entry lives. After a sync, entries whose original destination is a service
frontend and whose reply source is not one of that frontend's endpoints are deleted; that
covers both an endpoint going away and a service gaining endpoints after having none (the
entry then points at the frontend itself). TCP and SCTP entries are never touched.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field

from pyroute2 import Conntrack
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

log = logging.getLogger(__name__)

Address = tuple[str, int]


@dataclass
class UdpFrontends:
    """Service frontends of one family and the endpoints that may answer for them."""

    family: int
    by_address: dict[Address, set[Address]] = field(default_factory=dict)
    by_node_port: dict[int, set[Address]] = field(default_factory=dict)
    local_addresses: set[str] = field(default_factory=set)

    def stale(self, destination: Address, reply_source: Address) -> bool:
        allowed = self.by_address.get(destination)
        if allowed is None and destination[0] in self.local_addresses:
            allowed = self.by_node_port.get(destination[1])
        return allowed is not None and reply_source not in allowed

    def __bool__(self) -> bool:
        return bool(self.by_address or self.by_node_port)


def clear_stale(frontends: UdpFrontends) -> int:
    """Delete the stale UDP entries; returns how many were deleted."""
    if not frontends:
        return 0
    af = socket.AF_INET if frontends.family == 4 else socket.AF_INET6
    deleted = 0
    with Conntrack() as ct:
        stale = [
            entry
            for entry in ct.dump_entries(
                tuple_orig=NFCTAttrTuple(family=af, proto=socket.IPPROTO_UDP)
            )
            if entry.tuple_orig.family == af
            and frontends.stale(
                (entry.tuple_orig.daddr, entry.tuple_orig.dport),
                (entry.tuple_reply.saddr, entry.tuple_reply.sport),
            )
        ]
        for entry in stale:
            try:
                ct.delete(entry)
                deleted += 1
            except Exception as err:  # the entry may have expired meanwhile
                log.debug("conntrack delete failed: %s", err)
    return deleted
