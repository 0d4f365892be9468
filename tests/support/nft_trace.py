"""Where a packet goes through a fake ruleset (tests/support/nft_fake.py): every base chain
on each hook of its path, in priority order across tables, its rules evaluated as the
kernel would.

`numgen random` is followed down every branch: the trace holds one outcome per way the
packet can go (a path is replayed with each choice in turn). Conntrack is the packet's own:
its state and whether its entry is DNATed are given, nat chains see only a new connection's
packet, and a DNAT shows in later hooks' addresses and in `ct status dnat`. `fib ... type
local` answers from the node's addresses given (loopback always local). A named limit is
taken as under its rate. An `update` of a dynamic set is recorded, not applied: a test seeds
a set with a transaction of its own.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import assert_never

from tests.support.nft_fake import (
    ADDRESS_TYPE_LOCAL,
    BREAK,
    CONTINUE,
    CT_STATES,
    CT_STATUS_DNAT,
    PROTOCOL_NUMBERS,
    Chain,
    Counter,
    DNat,
    DNatMap,
    Item,
    Limit,
    Log,
    Lookup,
    Masquerade,
    Match,
    NftError,
    Rule,
    Ruleset,
    Selector,
    SetMark,
    Table,
    Terminal,
    Update,
    Verdict,
    VerdictMap,
)

FORWARDED = ("prerouting", "forward", "postrouting")
"""A packet routed through the node: from a pod, or from outside to a pod."""
TO_NODE = ("prerouting", "input")
FROM_NODE = ("output", "postrouting")
"""A packet the node itself sends."""

Target = tuple[str, int]


@dataclass(frozen=True)
class Packet:
    saddr: str
    daddr: str
    dport: int
    protocol: str = "tcp"
    state: str = "new"
    """Its conntrack state: new, established, related or invalid."""
    dnat: bool = False
    """Its conntrack entry is DNATed (an established Service connection)."""
    mark: int = 0
    ct_mark: int = 0
    """Its conntrack entry's mark."""
    local: tuple[str, ...] = ()
    """The node's addresses, which `fib ... type local` finds."""

    @property
    def family(self) -> int:
        return ipaddress.ip_address(self.saddr).version


@dataclass(frozen=True)
class Outcome:
    """One way the packet can go."""

    verdict: str
    """accept, drop or reject."""
    target: Target | None
    """Where a DNAT sent it."""
    masqueraded: bool
    updates: tuple[str, ...]
    """`set <- key` for each dynamic set it was added to."""
    visited: tuple[str, ...]
    """Every rule that matched, as `table chain: rule`, and each base chain's verdict."""


@dataclass(frozen=True)
class Trace:
    packet: Packet
    outcomes: tuple[Outcome, ...]

    @property
    def verdicts(self) -> frozenset[str]:
        return frozenset(outcome.verdict for outcome in self.outcomes)

    @property
    def verdict(self) -> str:
        """The verdict every way the packet can go agrees on."""
        if len(self.verdicts) != 1:
            raise AssertionError(f"several verdicts:\n{self}")
        (verdict,) = self.verdicts
        return verdict

    @property
    def targets(self) -> frozenset[Target]:
        """Where an accepted packet may be DNATed to."""
        return frozenset(
            o.target for o in self.outcomes if o.verdict == "accept" and o.target is not None
        )

    @property
    def masqueraded(self) -> frozenset[bool]:
        """Whether it is masqueraded, over every way it can go."""
        return frozenset(outcome.masqueraded for outcome in self.outcomes)

    def to(self, target: Target) -> Outcome:
        """The way the packet reaches `target`."""
        (outcome,) = [o for o in self.outcomes if o.target == target]
        return outcome

    def __str__(self) -> str:
        lines = [str(self.packet)]
        for number, outcome in enumerate(self.outcomes, 1):
            lines.append(f"way {number}: {outcome.verdict} to {outcome.target}")
            lines += [f"    {step}" for step in outcome.visited]
        return "\n".join(lines)


class Choices:
    """The random draws of one walk: replayed from `planned`, then 0, each recorded with
    how many values it had, so that the next walk can take the next untried branch."""

    def __init__(self, planned: list[int]) -> None:
        self.planned = planned
        self.made: list[tuple[int, int]] = []

    def draw(self, modulus: int) -> int:
        index = len(self.made)
        value = self.planned[index] if index < len(self.planned) else 0
        self.made.append((value, modulus))
        return value

    def next_plan(self) -> list[int] | None:
        """The draws of the next walk, the last draw with a value left moved on; None when
        every branch was walked."""
        for index in reversed(range(len(self.made))):
            value, modulus = self.made[index]
            if value + 1 < modulus:
                return [made for made, _ in self.made[:index]] + [value + 1]
        return None


def _number(address: str) -> int:
    return int(ipaddress.ip_address(address))


def _address(family: int, number: int) -> str:
    return str(ipaddress.IPv4Address(number) if family == 4 else ipaddress.IPv6Address(number))


@dataclass
class Flight:
    """A packet on one walk: its fields as they change, and what happened to it."""

    family: int
    saddr: int
    daddr: int
    protocol: int
    dport: int
    state: int
    status: int
    mark: int
    ct_mark: int
    local: frozenset[int]
    choices: Choices
    target: Target | None = None
    masqueraded: bool = False
    updates: list[str] = field(default_factory=list)
    visited: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, packet: Packet, choices: Choices) -> Flight:
        if packet.protocol not in PROTOCOL_NUMBERS or packet.state not in CT_STATES:
            raise ValueError(f"a packet the tracer does not know: {packet}")
        return cls(
            family=packet.family,
            saddr=_number(packet.saddr),
            daddr=_number(packet.daddr),
            protocol=PROTOCOL_NUMBERS[packet.protocol],
            dport=packet.dport,
            state=CT_STATES[packet.state],
            status=CT_STATUS_DNAT if packet.dnat else 0,
            mark=packet.mark,
            ct_mark=packet.ct_mark,
            local=frozenset(_number(address) for address in packet.local),
            choices=choices,
        )

    def is_local(self, address: int) -> bool:
        loopback = ipaddress.ip_network("127.0.0.0/8" if self.family == 4 else "::1/128")
        first, last = int(loopback.network_address), int(loopback.broadcast_address)
        return address in self.local or first <= address <= last

    def read(self, selector: Selector) -> int | None:
        """The selector's value for this packet; None when it has none (`udp dport` of a
        TCP packet), which fails the rule."""
        if selector.protocol is not None and selector.protocol != self.protocol:
            return None
        if selector.modulus:
            return self.choices.draw(selector.modulus)
        if selector.text.endswith("dport"):
            return self.dport
        values = {
            "ip saddr": self.saddr,
            "ip6 saddr": self.saddr,
            "ip daddr": self.daddr,
            "ip6 daddr": self.daddr,
            "meta l4proto": self.protocol,
            "meta mark": self.mark,
            "ct mark": self.ct_mark,
            "ct state": self.state,
            "ct status": self.status,
            "fib saddr type": ADDRESS_TYPE_LOCAL if self.is_local(self.saddr) else 1,
            "fib daddr type": ADDRESS_TYPE_LOCAL if self.is_local(self.daddr) else 1,
        }
        if selector.text not in values:
            raise NftError(f"the tracer cannot read {selector.text}")
        return values[selector.text]

    def key(self, selectors: Sequence[Selector]) -> tuple[int, ...] | None:
        values = [self.read(selector) for selector in selectors]
        return None if None in values else tuple(v for v in values if v is not None)

    def dnat(self, address: int, port: int) -> Verdict:
        self.daddr, self.dport = address, port
        self.status |= CT_STATUS_DNAT
        self.target = (_address(self.family, address), port)
        return Verdict("accept")


def _matches(item: Match, flight: Flight) -> bool:
    key = flight.key(item.selectors)
    if key is None:
        return False
    (selector, *_) = item.selectors
    if item.mask is not None:
        key = (key[0] & item.mask,)
    if selector.datatype.bitmask:
        found = any(key[0] & literal[0][0] for literal in item.keys)
    else:
        found = any(
            all(low <= part <= high for part, (low, high) in zip(key, literal, strict=True))
            for literal in item.keys
        )
    return found != item.negated


def _run_item(item: Item, table: Table, flight: Flight) -> Verdict:
    """CONTINUE to the rule's next item, BREAK when the rule does not match, or a verdict."""
    match item:
        case Match():
            return CONTINUE if _matches(item, flight) else BREAK
        case Lookup(selectors, set_name, negated):
            key = flight.key(selectors)
            if key is None:
                return BREAK
            found, _ = table.sets[set_name].get(key)
            return CONTINUE if found != negated else BREAK
        case VerdictMap(selectors, map_name):
            key = flight.key(selectors)
            found, value = table.sets[map_name].get(key) if key is not None else (False, None)
            return value if found and isinstance(value, Verdict) else BREAK
        case DNatMap(selectors, map_name):
            key = flight.key(selectors)
            found, value = table.sets[map_name].get(key) if key is not None else (False, None)
            if not found or not isinstance(value, tuple):
                return BREAK
            address, port = value
            return flight.dnat(address, port)
        case DNat(address, port):
            return flight.dnat(_number(address), port)
        case Masquerade():
            flight.masqueraded = True
            return Verdict("accept")
        case SetMark(operator, operand):
            results = {
                None: operand,
                "|": flight.mark | operand,
                "^": flight.mark ^ operand,
                "&": flight.mark & operand,
            }
            flight.mark = results[operator]
            return CONTINUE
        case Update(set_name, selectors):
            key = flight.key(selectors)
            if key is not None:
                shown = " . ".join(
                    _address(flight.family, part) if selector.family else str(part)
                    for part, selector in zip(key, selectors, strict=True)
                )
                flight.updates.append(f"{set_name} <- {shown}")
            return CONTINUE
        case Counter() | Limit() | Log():
            return CONTINUE
        case Terminal(verdict):
            return verdict
    assert_never(item)


def _run_rule(rule: Rule, table: Table, flight: Flight) -> Verdict | None:
    """The rule's verdict (CONTINUE: it matched without one); None when it did not match."""
    for item in rule.items:
        verdict = _run_item(item, table, flight)
        if verdict == BREAK:
            return None
        if verdict != CONTINUE:
            return verdict
    return CONTINUE


def _run_base_chain(table: Table, base: Chain, flight: Flight) -> str:
    """accept, drop or reject: what the base chain decides, its policy when nothing does."""
    assert base.hook is not None
    callers: list[tuple[Chain, int]] = []
    chain, index = base, 0
    while True:
        if index == len(chain.rules):
            if not callers:
                return base.hook.policy
            chain, index = callers.pop()
            continue
        rule = chain.rules[index]
        index += 1
        verdict = _run_rule(rule, table, flight)
        if verdict is None:
            continue
        flight.visited.append(f"{table.name} {chain.name}: {rule.text}")
        if verdict.kind in ("accept", "drop", "reject"):
            return verdict.kind
        if verdict.kind == "jump":
            callers.append((chain, index))
        if verdict.kind in ("jump", "goto"):
            assert verdict.chain is not None
            chain, index = table.chains[verdict.chain], 0
        elif verdict.kind == "return":
            if not callers:
                return base.hook.policy
            chain, index = callers.pop()


def _walk(ruleset: Ruleset, packet: Packet, hooks: Sequence[str], choices: Choices) -> Outcome:
    flight = Flight.of(packet, choices)
    verdict = "accept"
    for hook in hooks:
        for table, chain in ruleset.base_chains(flight.family, hook):
            assert chain.hook is not None
            # nat chains see only the first packet of a connection
            if chain.hook.type == "nat" and flight.state != CT_STATES["new"]:
                continue
            verdict = _run_base_chain(table, chain, flight)
            flight.visited.append(f"{table.name} {chain.name} ({hook}): {verdict}")
            if verdict != "accept":
                break
        if verdict != "accept":
            break
    return Outcome(
        verdict,
        flight.target,
        flight.masqueraded,
        tuple(flight.updates),
        tuple(flight.visited),
    )


def trace(ruleset: Ruleset, packet: Packet, hooks: Sequence[str]) -> Trace:
    """Every way `packet` can go along `hooks` (FORWARDED, TO_NODE, FROM_NODE)."""
    outcomes: list[Outcome] = []
    plan: list[int] | None = []
    while plan is not None:
        choices = Choices(plan)
        outcomes.append(_walk(ruleset, packet, hooks, choices))
        plan = choices.next_plan()
    return Trace(packet, tuple(outcomes))
