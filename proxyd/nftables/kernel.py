"""Thin layer over the kernel's nftables: transactions through the `nft` binary (one per
process, several in a row loaded while the next is made), and the names of what a table holds
(for full syncs) through a netlink dump (pyroute2: ~1 ms in-process, where an `nft list`
process costs ~4 ms).

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

import subprocess
from collections.abc import Iterable
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.nftables.main import NFTables

from proxyd.nftables.render import TABLE, family_name

NFPROTO = {4: 2, 6: 10}
"""Family -> NFPROTO_IPV4 / NFPROTO_IPV6."""
NOT_NAMED_SETS = {"NFT_SET_MAP", "NFT_SET_ANONYMOUS"}


class NftError(RuntimeError):
    pass


class Nft:
    def __init__(self, family: int, table: str = TABLE) -> None:
        self.family = family
        self.table_name = table
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

    def chains(self) -> set[str]:
        """Names of the chains our table holds (none when it does not exist)."""
        return {chain.get_attr("NFTA_CHAIN_NAME") for chain in self._ours("CHAIN")}

    def sets(self) -> set[str]:
        """Names of the named sets (not maps) our table holds."""
        return {
            found.get_attr("NFTA_SET_NAME")
            for found in self._ours("SET")
            if not NOT_NAMED_SETS & (found.get_attr("NFTA_SET_FLAGS") or set())
        }

    def _ours(self, kind: str) -> list[Any]:
        """Our table's chains or sets (kind "CHAIN" or "SET"), from one netlink dump."""
        try:
            with NFTables(nfgen_family=NFPROTO[self.family]) as nft:
                dump = list(nft.get_chains() if kind == "CHAIN" else nft.get_sets())
        except NetlinkError as err:
            raise NftError(f"listing {kind.lower()}s failed: {err}") from err
        return [item for item in dump if item.get_attr(f"NFTA_{kind}_TABLE") == self.table_name]

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
