"""Pure: the nft transaction (`nft -f` text, one atomic batch) taking the table from what was
written to what is wanted.

A full sync declares the whole table, flushes the chains and maps that exist and refills
them, and removes stale chains and sets (affinity sets that stay keep their entries). A
partial sync touches only the changed service ports: their map elements (added or removed),
the shared spread chains that gain their first user or lose their last, and the chains and
affinity sets of ports that own some, so its cost does not depend on how many services
exist.

Two services may claim the same map key (the same external IP and port, say); the first
claimant by name owns it, and when it lets go the next one takes over.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from proxyd.model import ServicePortName
from proxyd.nftables.render import (
    TABLE,
    BaseObjects,
    Element,
    ServiceObjects,
    Spread,
    family_name,
)

log = logging.getLogger(__name__)

MapKey = tuple[str, str]
"""(map, element key)."""


@dataclass
class TableState:
    """Everything written to one family's table."""

    base: BaseObjects
    services: dict[ServicePortName, ServiceObjects] = field(default_factory=dict)
    claims: dict[MapKey, dict[ServicePortName, str]] = field(default_factory=dict)
    """Who wants each map key, with the verdict each wants."""
    owners: dict[MapKey, ServicePortName] = field(default_factory=dict)
    spread_users: dict[Spread, int] = field(default_factory=dict)
    """How many service ports go through each spread chain written."""


class Transaction:
    def __init__(self, family: int) -> None:
        self.prefix = f"{family_name(family)} {TABLE}"
        self.declarations: list[str] = []
        self.rules: list[str] = []
        self.removals: list[str] = []
        self.additions: list[str] = []
        self.teardown: list[str] = []

    def chain(self, name: str, rules: Iterable[str], exists: bool) -> None:
        verb = "flush" if exists else "add"
        self.declarations.append(f"{verb} chain {self.prefix} {name}")
        self.rules += [f"add rule {self.prefix} {name} {rule}" for rule in rules]

    def remove_chains(self, names: Iterable[str]) -> None:
        names = list(names)
        self.teardown[:0] = [f"flush chain {self.prefix} {name}" for name in names]
        self.teardown += [f"delete chain {self.prefix} {name}" for name in names]

    def remove_sets(self, names: Iterable[str]) -> None:
        self.teardown += [f"delete set {self.prefix} {name}" for name in names]

    def text(self) -> str:
        lines = [*self.declarations, *self.rules, *self.removals, *self.additions, *self.teardown]
        return "\n".join(lines) + "\n" if lines else ""


def _add_elements(tx: Transaction, elements: dict[str, list[Element]]) -> None:
    for map_name, items in sorted(elements.items()):
        if items:
            body = ", ".join(
                f"{key} : {verdict}" if verdict else key for key, verdict in sorted(items)
            )
            tx.additions.append(f"add element {tx.prefix} {map_name} {{ {body} }}")


def _claim(state: TableState, name: ServicePortName, objects: ServiceObjects) -> None:
    claims = state.claims
    for map_name, items in objects.elements.items():
        for key, verdict in items:
            map_key = (map_name, key)
            wanted = claims.get(map_key)
            if wanted is None:
                claims[map_key] = {name: verdict}
            else:
                wanted[name] = verdict


def _owner(state: TableState, map_key: MapKey) -> tuple[ServicePortName, str] | None:
    wanted = state.claims.get(map_key)
    if not wanted:
        return None
    if len(wanted) == 1:
        return next(iter(wanted.items()))
    name = min(wanted)
    if len(set(wanted.values())) > 1:
        others = ", ".join(str(n) for n in sorted(wanted) if n != name)
        log.warning("%s %s is claimed by %s too; %s keeps it", *map_key, others, name)
    return name, wanted[name]


def full_transaction(
    family: int, state: TableState, existing_chains: set[str], existing_sets: set[str]
) -> str:
    """Write `state` whole over whatever the table holds; fills in state's claims/owners."""
    tx = Transaction(family)
    tx.declarations.append(f"add table {tx.prefix}")
    for name, declaration in state.base.maps.items():
        kind = "map" if " : " in declaration else "set"
        tx.declarations.append(f"add {kind} {tx.prefix} {name} {declaration}")
        tx.declarations.append(f"flush {kind} {tx.prefix} {name}")
    for name, hook in state.base.hooks.items():
        tx.declarations.append(f"add chain {tx.prefix} {name} {{ {hook} ; policy accept ; }}")
    wanted_sets = set(state.base.maps)
    for objects in state.services.values():
        for name, declaration in objects.sets.items():
            wanted_sets.add(name)
            tx.declarations.append(f"add set {tx.prefix} {name} {declaration}")
    wanted_chains = set(state.base.hooks)
    for name, rules in state.base.chains.items():
        tx.chain(name, rules, name in existing_chains or name in state.base.hooks)
        wanted_chains.add(name)
    state.claims.clear()
    state.owners.clear()
    state.spread_users.clear()
    for service, objects in state.services.items():
        for name, rules in objects.chains.items():
            tx.chain(name, rules, name in existing_chains)
            wanted_chains.add(name)
        for spread in objects.spreads:
            state.spread_users[spread] = state.spread_users.get(spread, 0) + 1
        _claim(state, service, objects)
    for spread in sorted(state.spread_users):
        tx.chain(spread.name, spread.rules(family), spread.name in existing_chains)
        wanted_chains.add(spread.name)
    elements: dict[str, list[Element]] = {name: [] for name in state.base.maps}
    for map_key in state.claims:
        owner = _owner(state, map_key)
        if owner is not None:
            state.owners[map_key] = owner[0]
            elements[map_key[0]].append((map_key[1], owner[1]))
    _add_elements(tx, elements)
    tx.remove_chains(sorted(existing_chains - wanted_chains))
    tx.remove_sets(sorted(existing_sets - wanted_sets))
    return tx.text()


def partial_transaction(
    family: int, state: TableState, updates: dict[ServicePortName, ServiceObjects | None]
) -> str:
    """Write what the updated service ports' objects differ by (None: the port is gone), and
    record them in `state`, which is no longer the kernel's when the transaction fails."""
    tx = Transaction(family)
    stale_chains: list[str] = []
    stale_sets: list[str] = []
    was: dict[MapKey, tuple[ServicePortName, str] | None] = {}
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
            users = state.spread_users.get(spread, 0)
            spread_users_before.setdefault(spread, users)
            state.spread_users[spread] = users + (1 if spread in now.spreads else -1)
        keys = {
            (m, key)
            for objects in (before, now)
            for m, items in objects.elements.items()
            for key, _ in items
        }
        for map_key in keys:
            if map_key not in was:
                owner = state.owners.get(map_key)
                was[map_key] = None if owner is None else (owner, state.claims[map_key][owner])
        for map_name, items in before.elements.items():
            for key, _ in items:
                state.claims[(map_name, key)].pop(service, None)
        _claim(state, service, now)
        if after is None:
            state.services.pop(service, None)
        else:
            state.services[service] = after
    for spread, users in sorted(spread_users_before.items()):
        if not users and state.spread_users[spread]:
            tx.chain(spread.name, spread.rules(family), exists=False)
        elif users and not state.spread_users[spread]:
            stale_chains.append(spread.name)
        if not state.spread_users[spread]:
            del state.spread_users[spread]
    additions: dict[str, list[Element]] = {}
    for map_key, then in sorted(was.items()):
        now_owner = _owner(state, map_key)
        if not state.claims.get(map_key):
            state.claims.pop(map_key, None)
        if now_owner is None:
            state.owners.pop(map_key, None)
        else:
            state.owners[map_key] = now_owner[0]
        if now_owner == then:
            continue
        if then is not None:
            tx.removals.append(f"delete element {tx.prefix} {map_key[0]} {{ {map_key[1]} }}")
        if now_owner is not None:
            additions.setdefault(map_key[0], []).append((map_key[1], now_owner[1]))
    _add_elements(tx, additions)
    tx.remove_chains(stale_chains)
    tx.remove_sets(stale_sets)
    return tx.text()
