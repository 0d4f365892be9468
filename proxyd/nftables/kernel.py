"""Thin layer over the `nft` binary: one transaction per call, and the names of what a
table holds (for full syncs).

Why text through `nft -f` (see the README's "Why each library"): nft's parser and its
compiler to netlink are the reference implementation of the rule language and a transaction
is atomic. What a transaction costs beyond the kernel's own work is nft's cache: before each
one, nft 1.0.6 reads every chain of the table (about 14 ms for 10,000 chains, measured with
strace), and the kernel validates every chain reachable from the hooks after a transaction
that adds a jump or a DNAT (about 38 ms for 10,000 chains of 11 rules). The element-only
layout (see render.py) keeps both small; a change through libnftables in-process (ctypes)
cost the same as through the `nft` process.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable

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
        self.run_each((text,))

    def run_each(self, texts: Iterable[str]) -> None:
        """Run transactions in order, nft loading each while the caller makes the next (nft
        reads its whole input before it parses any, so the making of one transaction's text
        cannot overlap its load). Stops at the first refused."""
        loading: subprocess.Popen[str] | None = None
        try:
            for text in texts:
                if loading is not None:
                    loaded, loading = loading, None
                    _finish(loaded)
                if text:
                    loading = _start(text)
        finally:
            if loading is not None:
                _finish(loading)

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


def _start(text: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        ["nft", "-f", "-"],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    try:
        proc.stdin.write(text)
        proc.stdin.close()
    except BrokenPipeError:
        pass  # nft ended before reading it all; its stderr says why
    return proc


def _finish(proc: subprocess.Popen[str]) -> None:
    assert proc.stderr is not None
    errors = proc.stderr.read()
    proc.stderr.close()
    if proc.wait() != 0:
        raise NftError(f"nft -f failed: {errors.strip()[:2000]}")
