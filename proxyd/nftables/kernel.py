"""Thin layer over the `nft` binary: one transaction per call, and the names of what a
table holds (for full syncs).

Why text through `nft -f` (see the README's "Why each library"): nft's parser and its
compiler to netlink are the reference implementation of the rule language and a transaction
is atomic; a one-service change at 10,000 services cost the same through libnftables
in-process (ctypes) as through the `nft` process, and libnftables' JSON input goes through the
same library and cache (not measured separately). What costs is nft's cache: before each
transaction nft reads every chain and set of the family from the kernel, so the rule layout
keeps the number of chains small (see render.py).
"""

from __future__ import annotations

import re
import subprocess

from proxyd.nftables.render import TABLE, family_name

CHAIN_LINE = re.compile(r"^\s*chain (\S+) \{", re.MULTILINE)
SET_LINE = re.compile(r"^\s*set (\S+) \{", re.MULTILINE)


class NftError(RuntimeError):
    pass


class Nft:
    def __init__(self, family: int, table: str = TABLE) -> None:
        self.family = family
        self.table = f"{family_name(family)} {table}"

    def run(self, text: str) -> None:
        if not text:
            return
        proc = subprocess.run(
            ["nft", "-f", "-"], input=text, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise NftError(f"nft -f failed: {proc.stderr.strip()[:2000]}")

    def _list(self, what: str, pattern: re.Pattern[str]) -> set[str]:
        proc = subprocess.run(
            ["nft", "--terse", "list", what, family_name(self.family)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise NftError(f"nft list {what} failed: {proc.stderr.strip()}")
        names: set[str] = set()
        for block in proc.stdout.split("\ntable "):
            header = block.lstrip().removeprefix("table ").split(" {", 1)[0]
            if header == self.table:
                names.update(pattern.findall(block))
        return names

    def chains(self) -> set[str]:
        """Names of the chains our table holds (none when it does not exist)."""
        return self._list("chains", CHAIN_LINE)

    def sets(self) -> set[str]:
        """Names of the named sets (not maps) our table holds; --terse leaves out their
        elements (100,000 hairpin entries at 10,000 services)."""
        return self._list("sets", SET_LINE)

    def delete_table(self) -> bool:
        proc = subprocess.run(
            ["nft", "delete", "table", *self.table.split()], capture_output=True, check=False
        )
        return proc.returncode == 0
