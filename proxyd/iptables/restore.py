"""Pure: turn rendered rule sets into iptables-restore input (for --noflush).

A full sync declares (and so flushes) every chain the proxy owns and writes it whole, then
removes stale chains. A partial sync touches only what changed services contributed: their own
chains are rewritten whole, their rules in the shared dispatch chains are deleted (-D) and
inserted (-I) one by one, so a change costs the same at 10 services as at 10,000.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from proxyd.iptables.render import (
    SHARED_CHAINS,
    TABLES,
    BaseRules,
    Rules,
    ServiceRules,
    SharedKey,
    hook_target,
)
from proxyd.model import ServicePortName


@dataclass
class RuleSet:
    """Everything the proxy writes in one address family."""

    base: BaseRules
    services: dict[ServicePortName, ServiceRules] = field(default_factory=dict)

    def chains(self, table: str) -> dict[str, Rules]:
        """Every chain of the table with its rules in order (services first, then base tails)."""
        result: dict[str, list[str]] = {
            chain: [] for (tbl, chain) in self.base.chains if tbl == table
        }
        for rules in self.services.values():
            for (tbl, chain), shared in rules.shared.items():
                if tbl == table:
                    result[chain].extend(shared)
            if table == "nat":
                for chain, own in rules.chains.items():
                    result[chain] = list(own)
        for (tbl, chain), tail in self.base.chains.items():
            if tbl == table:
                result[chain].extend(tail)
        return {chain: tuple(rules) for chain, rules in result.items()}

    def chain_names(self, table: str) -> set[str]:
        """The table's chains, without building their rules."""
        names = {chain for tbl, chain in self.base.chains if tbl == table}
        if table == "nat":
            for rules in self.services.values():
                names.update(rules.chains)
        return names

    def rule_count(self, table: str) -> int:
        return sum(len(rules) for rules in self.chains(table).values())


@dataclass(frozen=True)
class TableSnapshot:
    """What a table holds that a full sync must know about."""

    chains: set[str]
    """The owned chains."""
    jumps: set[tuple[str, str]]
    """(built-in chain, target) of every jump in a built-in chain."""
    owned_hooks: tuple[str, ...] = ()
    """The rules (`-A <built-in chain> ...`) that jump into an owned chain."""


@dataclass
class Script:
    """iptables-restore input, built table by table."""

    declared: dict[str, list[str]] = field(default_factory=lambda: {t: [] for t in TABLES})
    deletions: dict[str, list[str]] = field(default_factory=lambda: {t: [] for t in TABLES})
    rules: dict[str, list[str]] = field(default_factory=lambda: {t: [] for t in TABLES})
    removed: dict[str, list[str]] = field(default_factory=lambda: {t: [] for t in TABLES})

    def rewrite(self, table: str, chain: str, rules: Rules) -> None:
        self.declared[table].append(f":{chain} - [0:0]")
        self.rules[table].extend(f"-A {chain} {rule}" for rule in rules)

    def insert(self, table: str, chain: str, rule: str) -> None:
        self.rules[table].append(f"-I {chain} 1 {rule}")

    def remove_chain(self, table: str, chain: str) -> None:
        self.declared[table].append(f":{chain} - [0:0]")
        self.removed[table].append(f"-X {chain}")

    def empty(self) -> bool:
        return not any(
            self.declared[t] or self.deletions[t] or self.rules[t] or self.removed[t]
            for t in TABLES
        )

    def text(self) -> str:
        lines: list[str] = []
        for table in TABLES:
            body = (
                self.declared[table]
                + self.deletions[table]
                + self.rules[table]
                + self.removed[table]
            )
            if body:
                lines += [f"*{table}", *body, "COMMIT"]
        return "\n".join(lines) + "\n" if lines else ""


def full_script(ruleset: RuleSet, existing: dict[str, set[str]]) -> Script:
    """Every owned chain written whole; `existing` owned chains not wanted are removed."""
    script = Script()
    for table in TABLES:
        wanted = ruleset.chains(table)
        for chain, rules in wanted.items():
            script.rewrite(table, chain, rules)
        for chain in sorted(existing.get(table, set()) - wanted.keys()):
            script.remove_chain(table, chain)
    return script


def batched_full_scripts(
    ruleset: RuleSet, existing: dict[str, set[str]], chains_per_script: int
) -> list[Script]:
    """A full sync in several transactions, for iptables-nft, whose restore time grows with the
    square of the chains one transaction creates, so batches cost far less than one
    transaction of them all (docs/benchmarks.md#iptables-mode).

    First the base chains, with shared chains that do not exist yet created empty; then the
    services' own chains, all chains of a service in one transaction; last the shared chains,
    rewritten whole, and the removal of stale chains. Each service is switched atomically and
    the dispatch to it never points at a missing chain.
    """
    scripts = [Script()]
    for (table, chain), tail in ruleset.base.chains.items():
        if (table, chain) not in SHARED_CHAINS:
            scripts[0].rewrite(table, chain, tail)
        elif chain not in existing.get(table, set()):
            scripts[0].rewrite(table, chain, ())
    current = Script()
    count = 0
    for rules in ruleset.services.values():
        if count and count + len(rules.chains) > chains_per_script:
            scripts.append(current)
            current, count = Script(), 0
        for chain, own in rules.chains.items():
            current.rewrite("nat", chain, own)
        count += len(rules.chains)
    if count:
        scripts.append(current)
    last = Script()
    for table in TABLES:
        wanted = ruleset.chains(table)
        for tbl, chain in SHARED_CHAINS:
            if tbl == table and chain in wanted:
                last.rewrite(table, chain, wanted[chain])
        for chain in sorted(existing.get(table, set()) - wanted.keys()):
            last.remove_chain(table, chain)
    scripts.append(last)
    return scripts


def full_scripts(
    ruleset: RuleSet,
    snapshots: dict[str, TableSnapshot],
    chains_per_script: int | None = None,
) -> list[Script]:
    """A full sync: every owned chain written whole (in batches, see batched_full_scripts,
    when chains_per_script is given), the owned chains in `snapshots` not wanted removed with
    the built-in chains' jumps into them (deleted by the first script: a chain still jumped to
    cannot go), and the base's hooks not yet in place inserted at the top of their built-in
    chains by the last script."""
    existing = {table: snapshot.chains for table, snapshot in snapshots.items()}
    if chains_per_script is None:
        scripts = [full_script(ruleset, existing)]
    else:
        scripts = batched_full_scripts(ruleset, existing, chains_per_script)
    for table, snapshot in snapshots.items():
        stale = snapshot.chains - ruleset.chain_names(table)
        scripts[0].deletions[table].extend(
            "-D" + hook[2:] for hook in snapshot.owned_hooks if hook_target(hook) in stale
        )
    for table, chain, rule in reversed(ruleset.base.hooks):
        present = snapshots.get(table)
        if present is None or (chain, hook_target(rule)) not in present.jumps:
            scripts[-1].insert(table, chain, rule)
    return scripts


def _shared_delta(script: Script, key: SharedKey, old: Rules, new: Rules) -> None:
    table, chain = key
    new_set = set(new)
    old_set = set(old)
    script.deletions[table].extend(f"-D {chain} {rule}" for rule in old if rule not in new_set)
    for rule in new:
        if rule not in old_set:
            script.insert(table, chain, rule)


def partial_script(old: RuleSet, new: RuleSet, changed: Iterable[ServicePortName]) -> Script:
    """Only the changes of the given service ports; both rule sets must share one base."""
    script = Script()
    empty = ServiceRules()
    for name in changed:
        before = old.services.get(name, empty)
        after = new.services.get(name, empty)
        if before == after:
            continue
        for chain, rules in after.chains.items():
            if before.chains.get(chain) != rules:
                script.rewrite("nat", chain, rules)
        for key in before.shared.keys() | after.shared.keys():
            _shared_delta(script, key, before.shared.get(key, ()), after.shared.get(key, ()))
        for chain in before.chains.keys() - after.chains.keys():
            script.remove_chain("nat", chain)
    return script
