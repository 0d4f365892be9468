"""Pure: the nft transactions (nft's text language, each one atomic batch) taking the table from
what was written to what is wanted: one per sync, or several when a full sync writes a table that
has no chains yet.

A full sync declares the table's fixed part, flushes the maps and the chains that exist, adds
the service ports a chunk at a time, each chunk as a partial sync adds its ports (each port
whole in one, in name order so that no port takes a contested key over from an earlier
chunk's), and removes stale chains and sets (affinity sets that stay keep their entries): one
transaction, made in pieces that nft parses while Python makes the next. A table without
chains is in no hook, so no packet depends on it: a full sync writing one commits the fixed
part and then each chunk as a transaction of its own, which nft also commits while Python
makes the next. A partial sync touches only the changed service ports: their map and set
elements (added or removed), the shared spread chains that gain their first user or lose
their last, and the chains and affinity sets of ports that own some, so its cost does not
depend on how many services exist.

Two services may want the same map key (the same external IP and port, say); the first by
name owns it, and when it lets go the next one takes over. A plain set holds an element while
any service port wants it (the hairpin entry of an endpoint several services share).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from proxyd.model import ServicePortName
from proxyd.nftables.render import BaseObjects, ServiceObjects, Spread, table_of

log = logging.getLogger(__name__)

MapKey = tuple[str, str]
"""(map, element key)."""
Owned = tuple[ServicePortName, str]
"""The owner of a map key and the value it wants there."""


@dataclass
class TableState:
    """Everything written to one family's table."""

    base: BaseObjects
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
    def __init__(self, family: int) -> None:
        self.prefix = table_of(family)
        self.declarations: list[str] = []
        self.rules: list[str] = []
        self.removals: list[str] = []
        self.additions: list[str] = []
        self.teardown: list[str] = []

    def chain(self, name: str, rules: Iterable[str], exists: bool) -> None:
        verb = "flush" if exists else "add"
        self.declarations.append(f"{verb} chain {self.prefix} {name}")
        self.rules += [f"add rule {self.prefix} {name} {rule}" for rule in rules]

    def add_elements(self, name: str, elements: Iterable[str]) -> None:
        """Elements as nft writes them: `key` in a set, `key : value` in a map."""
        body = ", ".join(elements)
        if body:
            self.additions.append(f"add element {self.prefix} {name} {{ {body} }}")

    def remove_chains(self, names: Iterable[str]) -> None:
        names = list(names)
        self.teardown[:0] = [f"flush chain {self.prefix} {name}" for name in names]
        self.teardown += [f"delete chain {self.prefix} {name}" for name in names]

    def remove_sets(self, names: Iterable[str]) -> None:
        self.teardown += [f"delete set {self.prefix} {name}" for name in names]

    def text(self) -> str:
        lines = [*self.declarations, *self.rules, *self.removals, *self.additions, *self.teardown]
        return "\n".join(lines) + "\n" if lines else ""


def full_transaction(
    family: int,
    state: TableState,
    chunks: Iterable[Mapping[ServicePortName, ServiceObjects]],
    existing_chains: set[str],
    existing_sets: set[str],
) -> Iterator[str]:
    """One transaction writing the table whole over whatever it holds, in pieces: the fixed
    part, with every map flushed and every chain that exists emptied; then each chunk of
    service ports as a partial sync adds them, recorded in `state` (which holds none yet), so
    in name order no port takes a contested key over from an earlier chunk's; then the chains
    and sets no longer wanted removed (affinity sets that stay keep their entries)."""
    assert not state.services
    tx = Transaction(family)
    tx.declarations.append(f"add table {tx.prefix}")
    for name, declaration in state.base.maps.items():
        kind = "map" if " : " in declaration else "set"
        tx.declarations.append(f"add {kind} {tx.prefix} {name} {declaration}")
        tx.declarations.append(f"flush {kind} {tx.prefix} {name}")
    for name, hook in state.base.hooks.items():
        tx.declarations.append(f"add chain {tx.prefix} {name} {{ {hook} ; policy accept ; }}")
    for name in sorted(existing_chains - state.base.chains.keys()):
        tx.declarations.append(f"flush chain {tx.prefix} {name}")
    for name, rules in state.base.chains.items():
        tx.chain(name, rules, name in existing_chains or name in state.base.hooks)
    yield tx.text()
    for chunk in chunks:
        yield partial_transaction(family, state, chunk)
    wanted_chains = {*state.base.chains, *(spread.name for spread in state.spread_users)}
    wanted_sets = set(state.base.maps)
    for objects in state.services.values():
        wanted_chains.update(objects.chains)
        wanted_sets.update(objects.sets)
    tx = Transaction(family)
    tx.remove_chains(sorted(existing_chains - wanted_chains))
    tx.remove_sets(sorted(existing_sets - wanted_sets))
    yield tx.text()


def fresh_transactions(
    family: int,
    state: TableState,
    chunks: Iterable[Mapping[ServicePortName, ServiceObjects]],
    replace: bool,
) -> Iterator[str]:
    """Write a table that has no chains in several transactions: `state`'s fixed part (it
    holds no service ports yet), in place of the table and whatever sets it has when `replace`
    (a deleted table costs the kernel ~11 ms, so a table that does not exist is not deleted),
    then each chunk of ports, recorded in `state` as they are written."""
    table = table_of(family)
    replaced = f"add table {table}\ndelete table {table}\n" if replace else ""
    yield replaced + "".join(full_transaction(family, state, (), set(), set()))
    for chunk in chunks:
        yield partial_transaction(family, state, chunk)


def partial_transaction(
    family: int, state: TableState, updates: Mapping[ServicePortName, ServiceObjects | None]
) -> str:
    """Write what the updated service ports' objects differ by (None: the port is gone), and
    record them in `state`, which is no longer the kernel's when the transaction fails."""
    tx = Transaction(family)
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
                tx.chain(name, rules, name in before.chains)
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
        if not users and state.spread_users[spread]:
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
            tx.removals.append(f"delete element {tx.prefix} {map_name} {{ {key} }}")
        if owned is not None:
            additions.setdefault(map_name, []).append(f"{key} : {owned[1]}")
    for (set_name, key), held in sorted(held_before.items()):
        if held and not state.holds(set_name, key):
            tx.removals.append(f"delete element {tx.prefix} {set_name} {{ {key} }}")
        elif not held and state.holds(set_name, key):
            additions.setdefault(set_name, []).append(key)
    for name, elements in sorted(additions.items()):
        tx.add_elements(name, elements)
    tx.remove_chains(stale_chains)
    tx.remove_sets(stale_sets)
    return tx.text()
