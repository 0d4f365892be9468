"""The proxy's own chains in the iptables of one family: snapshots of the chains it owns,
whole and partial restores of its rule sets, and their removal. Running the binaries and the
flavour come from cni.kernel.firewall, FirewallError from cni.kernel.errors."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

from cni.kernel.firewall import Iptables
from proxyd.iptables.render import TABLES
from proxyd.iptables.restore import RuleSet, Script, TableSnapshot, full_scripts

BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
JUMP = re.compile(r"(?:^| )-j (\S+)")


class IptablesKernel(Iptables):
    """Iptables, with the chains an owner (a predicate on chain names) holds."""

    def snapshot(self, table: str, owned: Callable[[str], bool]) -> TableSnapshot:
        """The owned chains of the table, the jumps from its built-in chains, and those of
        them that jump into owned chains."""
        chains: set[str] = set()
        jumps: set[tuple[str, str]] = set()
        owned_hooks: list[str] = []
        for line in self.save(table).splitlines():
            if line.startswith(":"):
                name = line[1:].split(" ", 1)[0]
                if owned(name):
                    chains.add(name)
            elif line.startswith("-A ") and (match := JUMP.search(line)) is not None:
                chain = line.split(" ", 2)[1]
                if chain in BUILTIN_CHAINS:
                    jumps.add((chain, match.group(1)))
                    if owned(match.group(1)):
                        owned_hooks.append(line)
        return TableSnapshot(chains, jumps, tuple(owned_hooks))

    def write(self, scripts: Iterable[Script]) -> None:
        """Restore each script that has something to do, in order."""
        for script in scripts:
            if not script.empty():
                self.restore(script.text())

    def write_full(
        self,
        ruleset: RuleSet,
        owned: Callable[[str], bool],
        chains_per_script: int | None = None,
    ) -> list[Script]:
        """Snapshot the owned chains and the hooks in place, then write the rule set whole,
        remove stale owned chains and add the missing hooks (restore.full_scripts); returns
        the scripts written."""
        snapshots = {table: self.snapshot(table, owned) for table in TABLES}
        scripts = full_scripts(ruleset, snapshots, chains_per_script)
        self.write(scripts)
        return scripts

    def remove_owned(self, owned: Callable[[str], bool]) -> int:
        """Remove every jump into owned chains from built-in chains, then the chains.

        Returns how many chains were removed.
        """
        lines: list[str] = []
        removed = 0
        for table in TABLES:
            snapshot = self.snapshot(table, owned)
            if not snapshot.chains and not snapshot.owned_hooks:
                continue
            removed += len(snapshot.chains)
            chains = sorted(snapshot.chains)
            lines += [f"*{table}", *("-D" + hook[2:] for hook in snapshot.owned_hooks)]
            lines += [f":{chain} - [0:0]" for chain in chains]
            lines += [f"-X {chain}" for chain in chains]
            lines.append("COMMIT")
        if lines:
            self.restore("\n".join(lines) + "\n")
        return removed
