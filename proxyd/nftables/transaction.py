"""Pure: the nft transactions (nft's text language, each one atomic batch) taking the table from
what was written to what is wanted: one per partial sync, several per full sync.

The maps and sets services fill go by one of two names, a generation's (`service-ips`, or
`service-ips-1`), and the rules name the live generation's. A full sync fills the other
generation beside the live one, a chunk of service ports per transaction, each chunk as a
partial sync adds its ports (each port whole in one, in name order so that no port takes a
contested key over from an earlier chunk's), while nft commits one chunk as Python makes the
next; no packet reaches the new maps until a last, small transaction rewrites the rules to
name them, then deletes the old generation and the chains and sets no longer wanted (affinity
sets that stay keep their entries). A chunk also rewrites the firewall and affinity chains of
its ports (their content is what the port wants either way) but leaves the shared spread
chains the live maps go to for that last transaction. A partial sync touches only the changed
service ports: their map and set elements (added or removed), the shared spread chains that
gain their first user or lose their last, and the chains and affinity sets of ports that own
some, so its cost does not depend on how many services exist.

Two services may want the same map key (the same external IP and port, say); the first by
name owns it, and when it lets go the next one takes over. A plain set holds an element while
any service port wants it (the hairpin entry of an endpoint several services share).
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from proxyd.model import ServicePortName
from proxyd.nftables.render import SERVICE_IPS, BaseObjects, ServiceObjects, Spread, table_of

log = logging.getLogger(__name__)

MapKey = tuple[str, str]
"""(map, element key)."""
Owned = tuple[ServicePortName, str]
"""The owner of a map key and the value it wants there."""
GENERATION_SUFFIXES = ("", "-1")
MAP_REFERENCE = re.compile(r"@([\w./-]+)")


@dataclass(frozen=True)
class Generation:
    """One of the two names of each map and set the services fill (`maps`, as render_base
    names them)."""

    maps: frozenset[str]
    index: int

    def name(self, name: str) -> str:
        """What the kernel calls `name` in this generation (other names stay as they are)."""
        return f"{name}{GENERATION_SUFFIXES[self.index]}" if name in self.maps else name

    def rule(self, rule: str) -> str:
        """The rule naming this generation's maps and sets."""
        return MAP_REFERENCE.sub(lambda ref: f"@{self.name(ref.group(1))}", rule)

    @property
    def other(self) -> Generation:
        return Generation(self.maps, 1 - self.index)

    def names(self) -> set[str]:
        return {self.name(name) for name in self.maps}


def generation_of(base: BaseObjects, index: int) -> Generation:
    return Generation(frozenset(base.maps), index)


def live_generation(
    base: BaseObjects, kernel_sets: set[str], services_chain: Callable[[], str | None]
) -> int | None:
    """The generation the table's rules name (None: neither): the one whose maps the table
    holds; when it holds both (a full sync that did not end), the one the listing of the
    `services` chain names (None: no such chain). Only then is the chain listed: nft fetches
    every element of the maps a listed chain names, which grows with the services
    (docs/benchmarks.md#nftables-mode-full-sync-at-10000-services-the-ways-compared)."""
    held = [i for i in (0, 1) if generation_of(base, i).name(SERVICE_IPS) in kernel_sets]
    if len(held) < 2:
        return held[0] if held else None
    named = set(MAP_REFERENCE.findall(services_chain() or ""))
    return next((i for i in held if generation_of(base, i).name(SERVICE_IPS) in named), None)


@dataclass(frozen=True)
class KernelTable:
    """What a full sync found in the table: its chains, and its sets and maps, by name."""

    chains: set[str] = field(default_factory=set)
    sets: set[str] = field(default_factory=set)


@dataclass
class TableState:
    """Everything written to one family's table."""

    base: BaseObjects
    generation: int = 0
    """The generation of maps and sets the rules name once this state is written."""
    kernel_chains: set[str] = field(default_factory=set)
    """Chains the kernel held when a full sync began, for it to flush before it rewrites them
    or to leave to its switch; emptied once its last transaction is made."""
    services: dict[ServicePortName, ServiceObjects] = field(default_factory=dict)
    owners: dict[str, dict[str, ServicePortName]] = field(default_factory=dict)
    """Map -> key -> the service port whose value the element holds (its objects in
    `services` hold the value)."""
    rivals: dict[MapKey, set[ServicePortName]] = field(default_factory=dict)
    """Every service port wanting a map key that more than one wants."""
    members: dict[str, Counter[str]] = field(default_factory=dict)
    """Plain set -> element -> how many service ports want it."""
    spread_users: Counter[Spread] = field(default_factory=Counter)
    """How many service ports go through each spread chain written."""

    def owned(self, map_name: str, key: str) -> Owned | None:
        owner = self.owners.get(map_name, {}).get(key)
        return None if owner is None else (owner, self._value(owner, map_name, key))

    def _value(self, service: ServicePortName, map_name: str, key: str) -> str:
        return self.services[service].elements[map_name][key]

    def holds(self, set_name: str, key: str) -> bool:
        return key in self.members.get(set_name, ())

    def claim(self, service: ServicePortName, objects: ServiceObjects) -> None:
        """Record what `objects` (already in `services`) want."""
        for map_name, items in objects.elements.items():
            owners = self.owners.setdefault(map_name, {})
            if owners.keys().isdisjoint(items):
                owners.update(dict.fromkeys(items, service))
                continue
            for key in items:
                owner = owners.setdefault(key, service)
                if owner is not service:
                    self._contest(map_name, key, owner, service)
        for set_name, keys in objects.members.items():
            counts = self.members.get(set_name)
            if counts is None:
                counts = self.members[set_name] = Counter()
            counts.update(keys)

    def _contest(
        self, map_name: str, key: str, owner: ServicePortName, other: ServicePortName
    ) -> None:
        self.rivals.setdefault((map_name, key), {owner}).add(other)
        first = min(owner, other)
        if self._value(owner, map_name, key) != self._value(other, map_name, key):
            names = (owner, other, first)
            log.warning("%s %s is wanted by %s and %s; %s keeps it", map_name, key, *names)
        self.owners[map_name][key] = first

    def release(self, service: ServicePortName, objects: ServiceObjects) -> None:
        """Forget what `objects` wanted."""
        for map_name, items in objects.elements.items():
            owners = self.owners[map_name]
            for key in items:
                rivals = self.rivals.get((map_name, key))
                if rivals is None:
                    del owners[key]
                    continue
                rivals.discard(service)
                owners[key] = min(rivals)
                if len(rivals) == 1:
                    del self.rivals[(map_name, key)]
            if not owners:
                del self.owners[map_name]
        for set_name, keys in objects.members.items():
            counts = self.members[set_name]
            for key in keys:
                counts[key] -= 1
                if not counts[key]:
                    del counts[key]
            if not counts:
                del self.members[set_name]


class Transaction:
    def __init__(self, family: int, generation: Generation) -> None:
        self.prefix = table_of(family)
        self.generation = generation
        self.declarations: list[str] = []
        self.rules: list[str] = []
        self.removals: dict[str, list[str]] = {}
        """Set or map -> the keys deleted from it, written as one statement: nft parses and
        checks a statement's set once, however many elements it names (a churn's sync of 100
        services, each replacing one endpoint, took 23-27 ms in libnftables with a statement
        per element, and 17.5-20.3 ms with one per set)."""
        self.additions: list[str] = []
        self.emptied: list[str] = []
        """Chains going away, flushed first: what they name is no longer in use after it."""
        self.released: list[str] = []
        """Maps and sets deleted once no chain going away names them."""
        self.teardown: list[str] = []

    def chain(self, name: str, rules: Iterable[str], exists: bool) -> None:
        verb = "flush" if exists else "add"
        self.declarations.append(f"{verb} chain {self.prefix} {name}")
        self.rules += [
            f"add rule {self.prefix} {name} {self.generation.rule(rule)}" for rule in rules
        ]

    def add_elements(self, name: str, elements: Iterable[str]) -> None:
        """Elements as nft writes them: `key` in a set, `key : value` in a map."""
        body = ", ".join(elements)
        if body:
            name = self.generation.name(name)
            self.additions.append(f"add element {self.prefix} {name} {{ {body} }}")

    def remove_element(self, name: str, key: str) -> None:
        self.removals.setdefault(self.generation.name(name), []).append(key)

    def remove_chains(self, names: Iterable[str]) -> None:
        names = list(names)
        self.emptied += [f"flush chain {self.prefix} {name}" for name in names]
        self.teardown += [f"delete chain {self.prefix} {name}" for name in names]

    def remove_sets(self, names: Iterable[str]) -> None:
        self.teardown += [f"delete set {self.prefix} {name}" for name in names]

    def text(self) -> str:
        lines = [
            *self.declarations,
            *self.rules,
            *(
                f"delete element {self.prefix} {name} {{ {', '.join(keys)} }}"
                for name, keys in self.removals.items()
            ),
            *self.additions,
            *self.emptied,
            *self.released,
            *self.teardown,
        ]
        return "\n".join(lines) + "\n" if lines else ""


def _kind(declaration: str) -> str:
    return "map" if " : " in declaration else "set"


def full_transactions(
    family: int,
    state: TableState,
    chunks: Iterable[Mapping[ServicePortName, ServiceObjects]],
    kernel: KernelTable,
) -> Iterator[str]:
    """A full sync over whatever the table holds, in `state`'s generation (not the live one),
    each text a transaction: the table and the generation's maps and sets, emptied; then each
    chunk of service ports as a partial sync adds them, recorded in `state` (which holds none
    yet), so in name order no port takes a contested key over from an earlier chunk's; then
    the rules, naming the new generation, and the removal of the old generation and of the
    chains and sets no longer wanted. The first text also makes every chain without a hook
    that does not exist, empty until the rules come, as elements may go to some
    (`reject-chain`, `external-local-…`); the hooked chains come with the rules."""
    assert not state.services
    generation = generation_of(state.base, state.generation)
    state.kernel_chains = set(kernel.chains)
    tx = Transaction(family, generation)
    tx.declarations.append(f"add table {tx.prefix}")
    for name, declaration in state.base.maps.items():
        kind, named = _kind(declaration), generation.name(name)
        tx.declarations.append(f"add {kind} {tx.prefix} {named} {declaration}")
        if named in kernel.sets:
            tx.declarations.append(f"flush {kind} {tx.prefix} {named}")
    for name in sorted(state.base.chains.keys() - state.base.hooks.keys()):
        tx.declarations.append(f"add chain {tx.prefix} {name}")
    yield tx.text()
    for chunk in chunks:
        yield partial_transaction(family, state, chunk)
    yield _switch(family, state, kernel)
    state.kernel_chains.clear()


def _switch(family: int, state: TableState, kernel: KernelTable) -> str:
    """The rules naming `state`'s generation, then the other generation and the chains and
    sets no longer wanted removed: the stale chains emptied first (a spread chain that lost
    its last user still names an old endpoint map), then the old maps and sets deleted, then
    the stale chains (the old maps' elements went to some) and sets."""
    generation = generation_of(state.base, state.generation)
    tx = Transaction(family, generation)
    for name, hook in state.base.hooks.items():
        tx.declarations.append(f"add chain {tx.prefix} {name} {{ {hook} ; policy accept ; }}")
    for name, rules in state.base.chains.items():
        tx.chain(name, rules, exists=True)
    spreads = {spread.name: spread for spread in state.spread_users}
    for name, spread in sorted(spreads.items()):
        if name in kernel.chains:
            tx.chain(name, spread.rules(family), exists=True)
    old = generation.other
    for name, declaration in state.base.maps.items():
        if old.name(name) in kernel.sets:
            tx.released.append(f"delete {_kind(declaration)} {tx.prefix} {old.name(name)}")
    wanted_chains = {*state.base.chains, *spreads}
    wanted_sets = generation.names() | old.names()
    for objects in state.services.values():
        wanted_chains.update(objects.chains)
        wanted_sets.update(objects.sets)
    tx.remove_chains(sorted(kernel.chains - wanted_chains))
    tx.remove_sets(sorted(kernel.sets - wanted_sets))
    return tx.text()


def partial_transaction(
    family: int, state: TableState, updates: Mapping[ServicePortName, ServiceObjects | None]
) -> str:
    """Write what the updated service ports' objects differ by (None: the port is gone), and
    record them in `state`, which is no longer the kernel's when the transaction fails."""
    tx = Transaction(family, generation_of(state.base, state.generation))
    stale_chains: list[str] = []
    stale_sets: list[str] = []
    owned_before: dict[MapKey, Owned | None] = {}
    held_before: dict[MapKey, bool] = {}
    spread_users_before: dict[Spread, int] = {}
    for service, after in sorted(updates.items()):
        before = state.services.get(service) or ServiceObjects()
        now = after or ServiceObjects()
        for name, declaration in now.sets.items():
            if name not in before.sets:
                tx.declarations.append(f"add set {tx.prefix} {name} {declaration}")
        for name, rules in now.chains.items():
            if before.chains.get(name) != rules:
                tx.chain(name, rules, name in before.chains or name in state.kernel_chains)
        stale_chains += [name for name in before.chains if name not in now.chains]
        stale_sets += [name for name in before.sets if name not in now.sets]
        for spread in before.spreads ^ now.spreads:
            users = state.spread_users[spread]
            spread_users_before.setdefault(spread, users)
            state.spread_users[spread] = users + (1 if spread in now.spreads else -1)
        for objects in (before, now):
            for map_name, items in objects.elements.items():
                for key in items:
                    if (map_name, key) not in owned_before:
                        owned_before[(map_name, key)] = state.owned(map_name, key)
            for set_name, keys in objects.members.items():
                for key in keys:
                    if (set_name, key) not in held_before:
                        held_before[(set_name, key)] = state.holds(set_name, key)
        state.release(service, before)
        if after is None:
            state.services.pop(service, None)
        else:
            state.services[service] = after
        state.claim(service, now)
    for spread, users in sorted(spread_users_before.items()):
        # A spread chain the kernel had when a full sync began is left to its switch.
        in_kernel = spread.name in state.kernel_chains
        if not users and state.spread_users[spread] and not in_kernel:
            tx.chain(spread.name, spread.rules(family), exists=False)
        elif users and not state.spread_users[spread]:
            stale_chains.append(spread.name)
        if not state.spread_users[spread]:
            del state.spread_users[spread]
    additions: dict[str, list[str]] = {}
    for (map_name, key), then in sorted(owned_before.items()):
        owned = state.owned(map_name, key)
        if owned == then:
            continue
        if then is not None:
            tx.remove_element(map_name, key)
        if owned is not None:
            additions.setdefault(map_name, []).append(f"{key} : {owned[1]}")
    for (set_name, key), held in sorted(held_before.items()):
        if held and not state.holds(set_name, key):
            tx.remove_element(set_name, key)
        elif not held and state.holds(set_name, key):
            additions.setdefault(set_name, []).append(key)
    for name, elements in sorted(additions.items()):
        tx.add_elements(name, elements)
    tx.remove_chains(stale_chains)
    tx.remove_sets(stale_sets)
    return tx.text()
