"""The daemon's nftables tables: transactions in nft's text language, and the names of what a
table holds and a chain's listing (for full syncs), through one libnftables context of this
process per family, kept open (the binding, shared with the plugin, is cni.kernel.nftables).

Why text (see docs/dependencies.md): nft's parser and its compiler to netlink are
the reference implementation of the rule language and a transaction is atomic. Why in this
process rather than through `nft -f` processes: a partial sync is a few elements, which the
context commits in less time than an nft process takes to start, and after any transaction
that deleted something (a replaced endpoint, a full sync's flushed maps) a process waits
again at exit, the kernel closing its netlink socket only after an RCU grace period; the
context's socket stays open, so nothing waits for that
(docs/benchmarks.md#nftables-mode-the-one-service-change). nft's memory for a full sync's
transactions is given back to the system after them (malloc_trim), as a process's would be when
it ended.
"""

from __future__ import annotations

import errno
import re
import socket
import struct
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from cni.kernel.nftables import Context, NftError, malloc_trim
from cni.kernel.rawnetlink import (
    NETLINK_NETFILTER,
    NFGENMSG,
    NetlinkSocket,
    RawNetlinkError,
    attribute,
    attributes,
)
from proxyd.nftables.render import TABLE, family_name, table_of

CHAIN_LINE = re.compile(r"^\s*chain (\S+) \{", re.MULTILINE)
NFT_MSG_GETTABLE, NFT_MSG_GETOBJ = (10 << 8) | 1, (10 << 8) | 19
"""nf_tables' subsystem, and its messages asking for a table and for stateful objects."""
NFTA_TABLE_NAME = 1
NFTA_OBJ_TABLE, NFTA_OBJ_NAME, NFTA_OBJ_TYPE, NFTA_OBJ_DATA = 1, 2, 3, 4
NFT_OBJECT_COUNTER = 1
NFTA_COUNTER_PACKETS = 2
NFPROTO = {4: socket.AF_INET, 6: socket.AF_INET6}
"""The netfilter families of ip and ip6 tables have the address families' numbers."""
SET_OR_MAP_LINE = re.compile(r"^\s*(?:set|map) (\S+) \{", re.MULTILINE)


class Nft:
    """One family's table, reached through a context opened by the first call, in the
    namespace the calling thread is in then."""

    def __init__(self, family: int, table: str = TABLE) -> None:
        self.family = family
        self.name = table
        self.table = table_of(family, table)
        self._opened: Context | None = None

    @property
    def _context(self) -> Context:
        if self._opened is None:
            self._opened = Context()
        return self._opened

    def open(self) -> None:
        """Open the context now (a few ms), ahead of the first transaction."""
        _ = self._context

    def run(self, text: str) -> None:
        """One transaction."""
        if text:
            self._context.run(text)

    def rehearse(self, text: str) -> None:
        """A dry run of one transaction: the kernel gets nothing (see Context.rehearse)."""
        self._context.rehearse(text)

    def run_each(self, texts: Iterable[str]) -> None:
        """Transactions in order, each loaded by a worker thread (ctypes lets go of the GIL)
        while the caller makes the next; stops at the first refused. When making one fails,
        the load under way ends before that error goes on. Then the memory nft took is given
        back."""
        context = self._context
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="nft") as loader:
                loading: Future[str] | None = None
                for text in texts:
                    if loading is not None:
                        loading.result()
                    loading = loader.submit(context.run, text) if text else None
                if loading is not None:
                    loading.result()
        finally:
            malloc_trim()

    def _list(self, what: str, pattern: re.Pattern[str]) -> set[str] | None:
        listing = self._context.run(f"list {what} {family_name(self.family)}")
        for block in listing.split("\ntable "):
            header = block.lstrip().removeprefix("table ").split(" {", 1)[0]
            if header == self.table:
                return set(pattern.findall(block))
        return None

    def chains(self) -> set[str] | None:
        """Names of the chains our table holds; None when the table does not exist (the
        listing names every table of the family, even one without chains)."""
        return self._list("chains", CHAIN_LINE)

    def sets(self) -> set[str]:
        """Names of the named sets and maps our table holds."""
        return (self._list("sets", SET_OR_MAP_LINE) or set()) | (
            self._list("maps", SET_OR_MAP_LINE) or set()
        )

    def chain(self, name: str) -> str:
        """One chain's listing (its rules)."""
        return self._context.run(f"list chain {self.table} {name}")

    def exists(self) -> bool:
        """Whether the table is in the kernel, asked with one netlink request naming it (nft's
        `list tables` first caches every rule of every table, iptables-nft's included:
        docs/benchmarks.md#networkpolicy-make-bench-policy)."""
        request = NFGENMSG.pack(NFPROTO[self.family], 0, 0)
        request += attribute(NFTA_TABLE_NAME, self.name.encode() + b"\0")
        try:
            with NetlinkSocket(NETLINK_NETFILTER) as sock:
                sock.request(NFT_MSG_GETTABLE, request)
        except RawNetlinkError as err:
            if err.errno == errno.ENOENT:
                return False
            raise
        return True

    def delete_table(self) -> bool:
        """Delete the table; whether it existed. Asked first, since the kernel aborts a
        transaction deleting an absent table, and each abort waits for an RCU grace period
        holding the namespace's nf_tables lock, which every other writer of rules
        (iptables-nft-restore included) then waits for."""
        try:
            if not self.exists():
                return False
            self._context.run(f"delete table {self.table}")
        except (OSError, NftError):  # a kernel without nf_tables, or deleted by another since
            return False
        return True


def counter_packets(family: int, table: str) -> dict[str, int]:
    """The packets each named counter of one of the family's tables counted, by name, read
    with one netlink dump the kernel filters to that table's counters. (nft's `list
    counters` first caches every rule of every table, iptables-nft's included, which a
    metrics scrape must not cost: docs/benchmarks.md#networkpolicy-make-bench-policy.)"""
    name = table.encode() + b"\0"
    request = NFGENMSG.pack(NFPROTO[family], 0, 0)
    request += attribute(NFTA_OBJ_TABLE, name)
    request += attribute(NFTA_OBJ_TYPE, struct.pack(">I", NFT_OBJECT_COUNTER))

    def read(_: int, payload: memoryview) -> tuple[str, int] | None:
        found = attributes(payload[NFGENMSG.size :])
        if bytes(found.get(NFTA_OBJ_TABLE, b"")) != name or NFTA_OBJ_DATA not in found:
            return None
        packets = attributes(found[NFTA_OBJ_DATA]).get(NFTA_COUNTER_PACKETS)
        if packets is None or len(packets) != 8:
            return None
        return bytes(found[NFTA_OBJ_NAME]).rstrip(b"\0").decode(), struct.unpack(">Q", packets)[0]

    with NetlinkSocket(NETLINK_NETFILTER) as sock:
        return dict(sock.dump(NFT_MSG_GETOBJ, request, read))
