"""Cuts the open connections a policy change no longer allows.

The policy table judges a connection by its first packet; the packets after it pass as
`established` (render.py). So after each sync that changed a family's table, the family's
conntrack entries are read, each TCP, UDP and SCTP entry is judged as a new connection by the
table now written (verdict.py), and the entries it would drop get the CUT_MARK bit in their
conntrack mark, whose packets the table drops, both ways; an entry whose connection a later
change allows again loses the bit. This is what network-policy-api asks of admin policies (a
verdict per packet) and what kube-network-policies' strict mode does; knit does it for
NetworkPolicies too, so a tightened policy means the same for connections open before it as
after (`--network-policy-existing-connections keep` leaves them open, the API's other
allowed reading).

Marked rather than deleted: a deleted entry is made again by the connection's next packet,
and when that comes from the end the policies do not restrict (a delayed ACK of the server's),
the connection is picked up as one that end opened, and allowed on. A marked entry lives on
while packets come, then times out as any other.

Entries to or from one of the node's own addresses are left alone: the node's traffic with
its pods crosses the input and output hooks, which the table does not judge.

The walks run on a thread of their own, so a policy sync (a new pod's isolation, say) never
waits for one; the changes that come during a walk are judged together by the next. Without a
pod the table judges, only the marked entries are read (the kernel picks them).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable

from cni.kernel.addresses import link_addresses
from cni.kernel.families import ADDRESS_FAMILIES
from cni.kernel.rawnetlink import NETLINK_NETFILTER, NetlinkSocket
from proxyd import conntrack
from proxyd.conntrack import Flow
from proxyd.metrics import Metrics, family_label
from proxyd.policy.compile import FamilyPolicy
from proxyd.policy.render import CUT_MARK
from proxyd.policy.verdict import Connection, Judge
from proxyd.runner import IDLE, BoundedFrequencyRunner

log = logging.getLogger(__name__)

KEEP, CUT = "keep", "cut"
EXISTING_CONNECTIONS = (CUT, KEEP)
"""What a policy change does to the connections it no longer allows (the first: default)."""


def _node_addresses(family: int) -> set[str]:
    return {a.address for a in link_addresses(family)}


def denied(judge: Judge, node_addresses: Iterable[str]) -> Callable[[Flow], bool]:
    """Whether an entry is one the table would drop now: neither end the node's own, and a
    chain of either end denies it."""
    own = {ipaddress.ip_address(a) for a in node_addresses}

    def check(flow: Flow) -> bool:
        source, destination = flow.source[0], flow.destination[0]
        if ipaddress.ip_address(source) in own or ipaddress.ip_address(destination) in own:
            return False
        connection = Connection(source, destination, flow.protocol, flow.destination[1])
        return judge.judges(connection) and not judge.allows(connection)

    return check


def misjudged(is_denied: Callable[[Flow], bool]) -> Callable[[Flow], bool]:
    """Whether an entry's mark says otherwise than the table: denied and not cut, or cut and
    allowed again."""
    return lambda flow: is_denied(flow) != bool(flow.mark & CUT_MARK)


class ConnectionCutter:
    def __init__(
        self,
        metrics: Metrics,
        node_addresses: Callable[[int], set[str]] = _node_addresses,
    ) -> None:
        self.metrics = metrics
        self.node_addresses = node_addresses
        self.runner = BoundedFrequencyRunner(self.cut, 0.0, IDLE)
        self._lock = threading.Lock()
        self._written: dict[int, FamilyPolicy] = {}
        """Per family, the table written since the last walk."""

    def written(self, family: int, policy: FamilyPolicy) -> None:
        """A sync wrote this table: its connections are judged on the walker's thread."""
        with self._lock:
            self._written[family] = policy
        self.runner.run()

    def cut(self) -> None:
        with self._lock:
            written, self._written = self._written, {}
        for family, policy in written.items():
            start = time.monotonic()
            try:
                cut, restored = self._cut(family, policy)
            except Exception:  # the walks' thread goes on: the next change walks again
                log.exception("IPv%d: cutting connections the policies deny failed", family)
                continue
            self.metrics.policy_cut_duration.observe(time.monotonic() - start)
            self.metrics.policy_cut_connections.labels(family_label(family)).inc(cut)
            if cut or restored:
                log.info(
                    "IPv%d: cut %d connections the policies no longer allow, restored %d "
                    "they allow again",
                    family,
                    cut,
                    restored,
                )

    def _cut(self, family: int, policy: FamilyPolicy) -> tuple[int, int]:
        """Marks the family's entries the table denies, unmarks those it allows again;
        returns how many of each. Two reads: the marked entries (the kernel picks them), and
        the entries with a judged pod at either end (the others are allowed, and skipped
        undecoded); the second is left out when no pod is judged."""
        check = misjudged(denied(Judge(policy), self.node_addresses(family)))
        address_family = ADDRESS_FAMILIES[family]
        judged = {socket.inet_pton(address_family, a) for a in (*policy.ingress, *policy.egress)}
        with NetlinkSocket(NETLINK_NETFILTER) as sock:
            wrong = {
                flow.identity: flow
                for flow in conntrack.flows(sock, address_family, check, marked=CUT_MARK)
            }
            if judged:
                for flow in conntrack.flows(sock, address_family, check, ends=judged):
                    wrong[flow.identity] = flow
            to_cut = [flow for flow in wrong.values() if not flow.mark & CUT_MARK]
            to_restore = [flow for flow in wrong.values() if flow.mark & CUT_MARK]
            return (
                conntrack.mark(sock, to_cut, CUT_MARK, on=True),
                conntrack.mark(sock, to_restore, CUT_MARK, on=False),
            )

    def start(self) -> threading.Thread:
        return self.runner.start("policy-cut")

    def stop(self) -> None:
        self.runner.stop()
