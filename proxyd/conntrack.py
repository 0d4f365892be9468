"""UDP conntrack cleanup through netlink (pyroute2).

UDP has no connection end, so a client keeps sending to an endpoint that is gone for as long
as its conntrack entry lives. After a sync, entries whose original destination is a service
frontend and whose reply source is not one of that frontend's endpoints are deleted; that
covers both an endpoint going away and a service gaining endpoints after having none (the
entry then points at the frontend itself). TCP and SCTP entries are never touched.

The kernel picks the entries to look at: one dump per frontend port, filtered on it
(CTA_FILTER, Linux 5.8 and later), costs a walk of the whole table in the kernel (10 ms for
10,000 entries here), where every UDP entry of the family decoded in Python costs 0.25-0.4 ms.
Past FILTERED_DUMPS_UP_TO ports (a full sync of many UDP services), past KERNEL_WALK_BUDGET
entries walked in all (a table of mostly TCP entries), or on a kernel that ignores the filter,
one dump of the family's UDP entries is asked for instead.
"""

from __future__ import annotations

import logging
import os
import re
import socket
from dataclasses import dataclass, field

from pyroute2 import Conntrack
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

log = logging.getLogger(__name__)

Address = tuple[str, int]
FILTERED_DUMPS_UP_TO = 16
KERNEL_WALK_BUDGET = 2_000_000


def kernel_filters_dumps() -> bool:
    """Whether this kernel filters conntrack dumps on a tuple (Linux 5.8)."""
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return release is not None and (int(release[1]), int(release[2])) >= (5, 8)


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

    @property
    def address_family(self) -> int:
        return socket.AF_INET if self.family == 4 else socket.AF_INET6

    def dump_filters(self, table_size: int) -> list[NFCTAttrTuple]:
        """The original-direction tuples the kernel is asked for: UDP to each frontend's port,
        or the family's UDP (see the module's notes). Ports alone: a filter naming an IPv6
        destination address matched no entry here (kernel 6.18), where the same filter on the
        port did."""
        udp = {"family": self.address_family, "proto": socket.IPPROTO_UDP}
        ports = sorted({port for _, port in self.by_address} | self.by_node_port.keys())
        too_many = len(ports) > FILTERED_DUMPS_UP_TO
        if too_many or len(ports) * table_size > KERNEL_WALK_BUDGET or not kernel_filters_dumps():
            return [NFCTAttrTuple(**udp)]
        return [NFCTAttrTuple(**udp, dport=port) for port in ports]


def clear_stale(frontends: UdpFrontends) -> int:
    """Delete the stale UDP entries; returns how many were deleted."""
    if not frontends:
        return 0
    deleted = 0
    with Conntrack(nfgen_family=frontends.address_family) as ct:
        stale = [
            entry
            for dump_filter in frontends.dump_filters(table_size=ct.count())
            for entry in ct.dump_entries(tuple_orig=dump_filter)
            if entry.tuple_orig.family == frontends.address_family
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
