"""Thin layer over the iptables binaries of one family, in the node's flavour."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterable

from cni.firewall import chain_listing_argv, detect_iptables_flavour, rules_of_chain
from proxyd.iptables.render import TABLES
from proxyd.iptables.restore import RuleSet, Script, TableSnapshot, full_scripts

BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
JUMP = re.compile(r"(?:^| )-j (\S+)")


class RestoreError(RuntimeError):
    pass


class Iptables:
    def __init__(self, family: int, flavour: str | None = None) -> None:
        self.family = family
        self.flavour = flavour or detect_iptables_flavour()
        prefix = "iptables" if family == 4 else "ip6tables"
        self.binary = f"{prefix}-{self.flavour}"
        self.save_binary = f"{prefix}-{self.flavour}-save"
        self.restore_binary = f"{prefix}-{self.flavour}-restore"

    def restore(self, text: str) -> None:
        proc = subprocess.run(
            [self.restore_binary, "--noflush", "-w", "5"],
            input=text,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RestoreError(f"{self.restore_binary} failed: {proc.stderr.strip()}")

    def save(self, table: str) -> str:
        proc = subprocess.run(
            [self.save_binary, "-t", table], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise RestoreError(f"{self.save_binary} -t {table} failed: {proc.stderr.strip()}")
        return proc.stdout

    def chain_rules(self, table: str, chain: str) -> list[str]:
        """One chain's rules as iptables-save prints them."""
        argv = chain_listing_argv(self.binary, self.flavour, table, chain)
        proc = subprocess.run(argv, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RestoreError(f"{' '.join(argv)} failed: {proc.stderr.strip()}")
        return rules_of_chain(proc.stdout, chain)

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
