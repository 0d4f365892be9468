"""Pure: whether a family's policy table lets a new connection through, decided from the
compiled policy (compile.FamilyPolicy) the way the rendered rules decide it (render.py): a
pod's traffic to itself passes; else the sender's egress chain judges it, if the sender has
one, and then the receiver's ingress chain, if the receiver has one. Only connections that
cross the forward hook are judged by the table; the node's own traffic to and from its pods
is not (see render.py), and `judges` says which are.

`allows` answers with a bool (the conntrack cut judges every entry with it); `decide` walks
the same rules and says which decided, for explaining a verdict (proxyd/explain/).
"""

from __future__ import annotations

import bisect
import ipaddress
from dataclasses import dataclass

from proxyd.policy.compile import ALLOW, NEXT, FamilyPolicy, Match, Origin
from proxyd.policy.model import INGRESS


@dataclass(frozen=True)
class Connection:
    """A connection as the forward hook sees its first packet: after the proxy's DNAT, before
    any masquerade on the way out. `protocol` as nft names it (tcp, udp, sctp)."""

    source: str
    destination: str
    protocol: str
    port: int


@dataclass(frozen=True)
class Step:
    """One verdict met on a pod chain: the rule at `index` of the chain's matches (its
    `origin`, where compiled with provenance), or the chain's end (`index` None)."""

    chain: str
    index: int | None
    verdict: str
    origin: Origin | None


@dataclass(frozen=True)
class Decision:
    """How a pod's chains for one direction judged a connection: each Pass gone through,
    then the step that decided (last)."""

    path: tuple[Step, ...]

    @property
    def allowed(self) -> bool:
        return self.path[-1].verdict == ALLOW

    @property
    def decided_by(self) -> Step:
        return self.path[-1]


class Judge:
    """One family's compiled policy, ready to judge connections (peer sets are indexed the
    first time a rule asks for them)."""

    def __init__(self, policy: FamilyPolicy) -> None:
        self.policy = policy
        self._starts: dict[str, tuple[list[int], list[int]]] = {}
        self._peer_ports: dict[str, frozenset[tuple[int, str, int]]] = {}
        # addresses as integers: the API's text and the kernel's may spell one differently
        self._local = {_number(a) for a in policy.local}
        self._egress = {_number(a): chain for a, chain in policy.egress.items()}
        self._ingress = {_number(a): chain for a, chain in policy.ingress.items()}

    def judges(self, connection: Connection) -> bool:
        """Whether the table has a chain for either end (else it lets the connection pass)."""
        return (
            _number(connection.source) in self._egress
            or _number(connection.destination) in self._ingress
        )

    def allows(self, connection: Connection) -> bool:
        source, destination = _number(connection.source), _number(connection.destination)
        if source == destination and source in self._local:
            return True
        egress = self._egress.get(source)
        if egress is not None and not self._passes(egress, connection, destination, destination):
            return False
        ingress = self._ingress.get(destination)
        return ingress is None or self._passes(ingress, connection, source, destination)

    def decide(self, direction: str, connection: Connection) -> Decision | None:
        """How the chains of the direction's pod (the sender's for egress, the receiver's for
        ingress) judge the connection; None when that pod has no chain for it. A pod's
        traffic to itself is not judged by chains: `allows` says so first."""
        source, destination = _number(connection.source), _number(connection.destination)
        if direction == INGRESS:
            chain, peer = self._ingress.get(destination), source
        else:
            chain, peer = self._egress.get(source), destination
        if chain is None:
            return None
        steps = self._walk(chain, connection, peer, destination)
        return Decision(
            tuple(
                Step(name, index, verdict, None if index is None else matches[index].origin)
                for name, index, verdict, matches in steps
            )
        )

    def _passes(self, chain: str, connection: Connection, peer: int, destination: int) -> bool:
        """Whether a pod chain (and the chains it goes on to) lets the connection on; `peer` is
        the address its rules match peers against (the destination for egress, the source
        for ingress)."""
        return self._walk(chain, connection, peer, destination)[-1][2] == ALLOW

    def _walk(
        self, chain: str, connection: Connection, peer: int, destination: int
    ) -> list[tuple[str, int | None, str, tuple[Match, ...]]]:
        """The verdicts met from a pod chain on: (chain, index of the deciding match or None
        for the chain's end, verdict, the chain's matches), each NEXT followed."""
        steps = []
        while True:
            pod_chain = self.policy.chains[chain]
            index = next(
                (
                    at
                    for at, match in enumerate(pod_chain.matches)
                    if self._matches(match, connection, peer, destination)
                ),
                None,
            )
            verdict = pod_chain.otherwise if index is None else pod_chain.matches[index].verdict
            steps.append((chain, index, verdict, pod_chain.matches))
            if verdict != NEXT or pod_chain.next is None:
                return steps
            chain = pod_chain.next

    def _matches(self, match: Match, connection: Connection, peer: int, destination: int) -> bool:
        if match.peer_ports is not None:
            key = (destination, connection.protocol, connection.port)
            return key in self._peer_port_set(match.peer_ports)
        if match.peers is not None and not self._in_peers(match.peers, peer):
            return False
        if match.protocol is not None and match.protocol != connection.protocol:
            return False
        if match.first is not None and match.last is not None:
            return match.first <= connection.port <= match.last
        return True

    def _in_peers(self, name: str, address: int) -> bool:
        if name not in self._starts:
            intervals = sorted(self.policy.peers.get(name, ()))
            self._starts[name] = ([i[0] for i in intervals], [i[1] for i in intervals])
        firsts, lasts = self._starts[name]
        at = bisect.bisect_right(firsts, address) - 1
        return at >= 0 and address <= lasts[at]

    def _peer_port_set(self, name: str) -> frozenset[tuple[int, str, int]]:
        if name not in self._peer_ports:
            self._peer_ports[name] = frozenset(
                (_number(address), protocol, port)
                for address, protocol, port in self.policy.peer_ports.get(name, ())
            )
        return self._peer_ports[name]


def _number(address: str) -> int:
    return int(ipaddress.ip_address(address))
