"""Pure: a family's policy (compile.FamilyPolicy) -> nft transactions, the whole table for a
full sync, or from what was written to what is wanted for a partial one.

The table (`ip knit-policy`, `ip6 knit-policy`) has one base chain on the forward hook, which
is where bridged pod-to-pod packets (br_netfilter), routed ones and DNATed Service traffic all
pass, after the proxy chose the backend. Its order: packets of connections a policy change
cut (a conntrack mark, cutter.py) dropped, packets of connections already allowed (conntrack)
accepted, a pod's traffic to itself, then the sender's egress chain if a policy judges its
egress (which returns when the packet is allowed), then the receiver's ingress chain if one
judges its ingress (which accepts it); what a pod chain denies it counts (in a named counter
of the pod's first chain's name) and drops. With logging on (flowlog.py), a verdict logged is
given by two rules: one logging the packet to NFLOG under the family's limit, and one for
the packets over it, counted as lost. The node's own traffic to and from its pods
passes the output and input hooks, not forward, so it is always allowed.

A partial transaction orders its commands so that nothing is referenced before it exists or
after it is gone: new sets, set elements (deleted before added, since intervals must not
overlap), new and rewritten chains, map elements, then removed chains and sets.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from proxyd.naming import NFT_COMMENT_MAX, within
from proxyd.nftables.render import address_words, family_name
from proxyd.policy.compile import ALLOW, DROP, NEXT, FamilyPolicy, Interval, Match, PodChain
from proxyd.policy.flowlog import GROUP, LIMIT, LOST, Logging, prefix
from proxyd.policy.quarantine import QUARANTINED

TABLE = "knit-policy"
FORWARD = "forward"
INGRESS_MAP = "ingress-pods"
EGRESS_MAP = "egress-pods"
SELF = "self"
FORWARD_HOOK = "type filter hook forward priority filter; policy accept;"
CUT_MARK = 0x40000000
"""The conntrack mark bit of connections a policy change cut (cutter.py): their packets are
dropped, both ways, until a change allows them again."""
ELEMENTS_PER_COMMAND = 1000
E = TypeVar("E")


def _address(family: int, value: int) -> str:
    return str(ipaddress.IPv4Address(value) if family == 4 else ipaddress.IPv6Address(value))


def _interval(family: int, interval: Interval) -> str:
    first, last = interval
    if first == last:
        return _address(family, first)
    return f"{_address(family, first)}-{_address(family, last)}"


def _text(lines: list[str]) -> str:
    return "\n".join(lines) + "\n" if lines else ""


class Renderer:
    """`logging`: what the pod chains hand to NFLOG (None: nothing)."""

    def __init__(self, family: int, logging: Logging | None = None) -> None:
        self.family = family
        self.logging = logging
        self.table = f"{family_name(family)} {TABLE}"
        self.l3, self.addr = address_words(family)

    # ------------------------------------------------------------ pieces
    def rule(self, match: Match, verdict: str, peer_field: str) -> str:
        if match.peer_ports is not None:
            return f"{self.l3} daddr . meta l4proto . th dport @{match.peer_ports} {verdict}"
        words = []
        if match.peers is not None:
            words.append(f"{self.l3} {peer_field} @{match.peers}")
        if match.protocol is not None:
            words.append(f"meta l4proto {match.protocol}")
        if match.first is not None:
            ports = str(match.first) if match.first == match.last else f"{match.first}-{match.last}"
            words.append(f"th dport {ports}")
        words.append(verdict)
        return " ".join(words)

    def chain_rules(self, chain: str, pod_chain: PodChain) -> list[str]:
        # egress chains return to the base chain, where the receiver's ingress is judged next
        allow, peer_field = (
            ("accept", "saddr") if chain.startswith("ingress") else ("return", "daddr")
        )
        verdicts = {
            ALLOW: allow,
            DROP: f"counter name {pod_chain.counter} drop",
            NEXT: f"goto {pod_chain.next}",
        }
        rules = []
        for index, match in enumerate(pod_chain.matches):
            for words in self._verdict(chain, index, match.verdict, verdicts[match.verdict]):
                rules.append(self.rule(match, words, peer_field))
        return [
            *rules,
            *self._verdict(chain, None, pod_chain.otherwise, verdicts[pod_chain.otherwise]),
        ]

    def _verdict(self, chain: str, index: int | None, verdict: str, words: str) -> list[str]:
        """The statements giving one verdict of a chain (the rule at `index`, None: the
        chain's end): when it is logged, a rule that logs and gives it under the limit, then
        one that counts the packet as lost and gives it (over the limit, the logging rule
        does not match)."""
        if self.logging is None or verdict not in self.logging.verdicts:
            return [words]
        log = f'limit name {LIMIT} log prefix "{prefix(chain, index, verdict)}" group {GROUP}'
        return [f"{log} {words}", f"counter name {LOST} {words}"]

    def _set_changes(
        self,
        name: str,
        was: frozenset[E] | None,
        now: frozenset[E],
        written: Callable[[Iterable[E]], set[str]],
        deletions: list[str],
        additions: list[str],
    ) -> None:
        """A set's elements as the compiler made them (an unchanged set is the same object):
        only what differs is written out, deletions apart from additions."""
        was = was or frozenset()
        if was is not now and was != now:
            deletions += self._elements("delete", name, written(was - now))
            additions += self._elements("add", name, written(now - was))

    def _peer_set_decl(self, name: str, policy: FamilyPolicy) -> str:
        flags = " flags interval;" if name in policy.ranged else ""
        return f"add set {self.table} {name} {{ type {self.addr};{flags} }}"

    def _peer_port_set_decl(self, name: str) -> str:
        return f"add set {self.table} {name} {{ type {self.addr} . inet_proto . inet_service; }}"

    def _elements(self, verb: str, name: str, elements: Iterable[str]) -> Iterator[str]:
        listed = sorted(elements)
        for start in range(0, len(listed), ELEMENTS_PER_COMMAND):
            chunk = ", ".join(listed[start : start + ELEMENTS_PER_COMMAND])
            yield f"{verb} element {self.table} {name} {{ {chunk} }}"

    def _peer_elements(self, intervals: Iterable[Interval]) -> set[str]:
        return {_interval(self.family, interval) for interval in intervals}

    def _peer_port_elements(self, elements: Iterable[tuple[str, str, int]]) -> set[str]:
        return {f"{address} . {protocol} . {port}" for address, protocol, port in elements}

    def _map_elements(self, entries: dict[str, str]) -> set[str]:
        return {f"{address} : jump {chain}" for address, chain in entries.items()}

    def _self_elements(self, local: Iterable[str]) -> set[str]:
        return {f"{address} . {address}" for address in local}

    def _chain(self, chain: str, policy: FamilyPolicy) -> list[str]:
        if chain in policy.quarantined:
            owner = QUARANTINED
        else:
            owner = within("/".join(policy.owners[policy.chains[chain].counter]), NFT_COMMENT_MAX)
        lines = [f'add chain {self.table} {chain} {{ comment "{owner}"; }}']
        lines += [
            f"add rule {self.table} {chain} {rule}"
            for rule in self.chain_rules(chain, policy.chains[chain])
        ]
        return lines

    # ------------------------------------------------------------ transactions
    def base(self, replacing: bool) -> list[str]:
        """The table's fixed part; `replacing`: a table is in the kernel, to go in the same
        transaction. (Deleting one that is not there would cost an RCU grace period after
        the commit, which the next iptables-nft rule with a match waits for, holding the
        kernel's nf_tables lock that our other family's transaction then waits for.)"""
        t = self.table
        logged = []
        if self.logging is not None:
            rate = self.logging.rate
            limit = f"rate {rate}/second burst {rate} packets"
            logged = [f"add limit {t} {LIMIT} {{ {limit}; }}", f"add counter {t} {LOST}"]
        return [
            *([f"add table {t}", f"delete table {t}"] if replacing else []),
            f'add table {t} {{ comment "knit NetworkPolicy"; }}',
            *logged,
            f"add map {t} {INGRESS_MAP} {{ type {self.addr} : verdict; }}",
            f"add map {t} {EGRESS_MAP} {{ type {self.addr} : verdict; }}",
            f"add set {t} {SELF} {{ type {self.addr} . {self.addr}; }}",
            f"add chain {t} {FORWARD} {{ {FORWARD_HOOK} }}",
            f"add rule {t} {FORWARD} ct mark & {CUT_MARK:#x} == {CUT_MARK:#x} drop",
            f"add rule {t} {FORWARD} ct state established,related accept",
            f"add rule {t} {FORWARD} {self.l3} saddr . {self.l3} daddr @{SELF} accept",
            f"add rule {t} {FORWARD} {self.l3} saddr vmap @{EGRESS_MAP}",
            f"add rule {t} {FORWARD} {self.l3} daddr vmap @{INGRESS_MAP}",
        ]

    def full(self, policy: FamilyPolicy, *, replacing: bool) -> str:
        """The whole table; `replacing`: one is in the kernel (whatever it holds)."""
        return _text(self.base(replacing) + self._changes(FamilyPolicy(), policy))

    def rehearsal(self) -> str:
        """A whole table with one of each kind of thing a sync writes (a peer set and its
        element, a pod chain with its rules and counter, map and self elements), of a
        documentation address: what nft rehearses at start, see Context.rehearse."""
        address = ipaddress.ip_address("192.0.2.1" if self.family == 4 else "2001:db8::1")
        chain, peers = "ingress-rehearsal", "peers-rehearsal"
        sample = FamilyPolicy(
            chains={chain: PodChain((Match(peers, "tcp", 80, 80),), DROP, chain)},
            ingress={str(address): chain},
            peers={peers: frozenset({(int(address), int(address))})},
            owners={chain: ("rehearsal", "rehearsal")},
            local=frozenset({str(address)}),
        )
        return self.full(sample, replacing=False)

    def partial(self, old: FamilyPolicy, new: FamilyPolicy) -> str:
        """The transaction from the table `old` describes to `new`."""
        return _text(self._changes(old, new))

    def _changes(self, before: FamilyPolicy, new: FamilyPolicy) -> list[str]:
        lines: list[str] = []
        t = self.table
        lines += [self._peer_set_decl(n, new) for n in new.peers.keys() - before.peers.keys()]
        lines += [
            self._peer_port_set_decl(n) for n in new.peer_ports.keys() - before.peer_ports.keys()
        ]
        additions: list[str] = []
        for name, now_peers in new.peers.items():
            self._set_changes(
                name, before.peers.get(name), now_peers, self._peer_elements, lines, additions
            )
        for name, now_ports in new.peer_ports.items():
            self._set_changes(
                name,
                before.peer_ports.get(name),
                now_ports,
                self._peer_port_elements,
                lines,
                additions,
            )
        lines += additions
        lines += [
            f"add counter {t} {chain}"
            for chain, pod_chain in new.chains.items()
            if pod_chain.counter == chain and chain not in before.chains
        ]
        for chain in new.chains:
            if chain not in before.chains:
                lines += self._chain(chain, new)
            elif before.chains[chain] != new.chains[chain]:
                lines.append(f"flush chain {t} {chain}")
                lines += [
                    f"add rule {t} {chain} {rule}"
                    for rule in self.chain_rules(chain, new.chains[chain])
                ]
        for name, was_map, now_map in (
            (INGRESS_MAP, before.ingress, new.ingress),
            (EGRESS_MAP, before.egress, new.egress),
        ):
            gone_entries = dict(was_map.items() - now_map.items())
            lines += self._elements("delete", name, self._map_elements(gone_entries))
            came_entries = dict(now_map.items() - was_map.items())
            lines += self._elements("add", name, self._map_elements(came_entries))
        lines += self._elements("delete", SELF, self._self_elements(before.local - new.local))
        lines += self._elements("add", SELF, self._self_elements(new.local - before.local))
        # a pod's first chain goes to its next one, so it goes first; both use its counter
        gone = [chain for chain in before.chains if chain not in new.chains]
        lines += [f"delete chain {t} {chain}" for chain in reversed(gone)]
        lines += [f"delete counter {t} {c}" for c in gone if before.chains[c].counter == c]
        lines += [f"delete set {t} {n}" for n in before.peers.keys() - new.peers.keys()]
        lines += [f"delete set {t} {n}" for n in before.peer_ports.keys() - new.peer_ports.keys()]
        return lines
