"""Thin layer over libnftables, the library behind the `nft` command: transactions in nft's
text language, and the names of what a table holds (for full syncs), through one context of
this process per family, kept open.

Why text (see the README's "Why each library"): nft's parser and its compiler to netlink are
the reference implementation of the rule language and a transaction is atomic. Why in this
process rather than through `nft -f` processes: a partial sync is a few elements, which the
context commits in ~0.5 ms, where an nft process costs ~3 ms to start and, after any
transaction that deleted something (a replaced endpoint, a full sync's flushed maps), ~10-20
ms more at exit, the kernel closing its netlink socket only after an RCU grace period; the
context's socket stays open, so nothing waits for that. A full sync's transaction reaches nft
through a pipe as it is being made: nft parses a file as it arrives (a buffer, or stdin, it
takes whole first), so the making and the parsing overlap. nft's memory for a full sync (~300
MiB at 10,000 services) is given back to the system after it (malloc_trim), as a process's
would be when it ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import os
import re
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from proxyd.nftables.render import TABLE, family_name, table_of

CHAIN_LINE = re.compile(r"^\s*chain (\S+) \{", re.MULTILINE)
SET_LINE = re.compile(r"^\s*set (\S+) \{", re.MULTILINE)
PIPE_SIZE = 1 << 20
"""A streamed transaction's pipe holds a whole piece (~0.86 MB for 1,000 ports of 10 endpoints),
so Python makes the next while nft parses it; through the default 64 KiB nft waited for each
piece's making (a steady full sync at 10,000 services took 1.9-2.4 s, against 1.6-2.0 s). Where
the system refuses the size, the default serves, only slower."""
UNPARSABLE = b"\nknit: the rest of this transaction could not be made\n"
"""Ends a transaction whose text could not be made whole: nft commits nothing it cannot parse."""
PIPED_LINE = re.compile(r"/proc/self/fd/\d+:(\d+):")
"""Where nft's error about a piped transaction points: it names the line but cannot quote it (it
would read the file again)."""
OUTPUT_TERSE = 1 << 11
"""libnftables' NFT_CTX_OUTPUT_TERSE: listings leave out set elements (and nft does not fetch
them: 100,000 hairpin entries at 10,000 services)."""


class NftError(RuntimeError):
    pass


class Context:
    """A libnftables context: its netlink socket, opened in the calling thread's network
    namespace, stays open (and bound to that namespace) until the context is collected.
    libnftables ends the process when it cannot allocate or open that socket, as it ends an
    nft process."""

    def __init__(self) -> None:
        lib = _libnftables()
        self._handle = lib.nft_ctx_new(0)
        lib.nft_ctx_output_set_flags(self._handle, OUTPUT_TERSE)
        lib.nft_ctx_buffer_output(self._handle)
        lib.nft_ctx_buffer_error(self._handle)
        weakref.finalize(self, lib.nft_ctx_free, self._handle)

    def run(self, text: str) -> str:
        """Run nft commands (one transaction); returns what they printed."""
        return self._outcome(_libnftables().nft_run_cmd_from_buffer(self._handle, text.encode()))

    def run_piped(self, reader: int) -> str:
        """Run the nft commands read from the pipe `reader` to its end (one transaction, parsed
        as it arrives), then close the pipe; returns what they printed."""
        try:
            path = f"/proc/self/fd/{reader}".encode()
            failed = _libnftables().nft_run_cmd_from_filename(self._handle, path)
        finally:
            os.close(reader)
        return self._outcome(failed)

    def _outcome(self, failed: int) -> str:
        lib = _libnftables()
        output = lib.nft_ctx_get_output_buffer(self._handle).decode(errors="replace")
        errors = lib.nft_ctx_get_error_buffer(self._handle).decode(errors="replace")
        if failed:
            raise NftError(f"nft transaction failed: {errors.strip()[:2000]}")
        return output


class Nft:
    """One family's table, reached through a context opened by the first call, in the
    namespace the calling thread is in then."""

    def __init__(self, family: int, table: str = TABLE) -> None:
        self.family = family
        self.table = table_of(family, table)
        self._opened: Context | None = None

    @property
    def _context(self) -> Context:
        if self._opened is None:
            self._opened = Context()
        return self._opened

    def run(self, text: str) -> None:
        """One transaction."""
        if text:
            self._context.run(text)

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
            _libc().malloc_trim(0)

    def run_streamed(self, pieces: Iterable[str]) -> None:
        """One transaction, its text made piece by piece while nft, in a worker thread (ctypes
        lets go of the GIL), parses what came before. When making a piece fails, nft is given
        a line it cannot parse, so it commits nothing, and that error goes on; when nft refuses
        the transaction, its error quotes the lines it names. Then the memory nft took is given
        back."""
        context = self._context
        made: list[str] = []
        reader, writer = os.pipe()
        with contextlib.suppress(OSError):
            fcntl.fcntl(writer, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="nft") as loader:
                try:
                    loading = loader.submit(context.run_piped, reader)
                except BaseException:
                    os.close(reader)
                    os.close(writer)
                    raise
                _feed(writer, pieces, made)
                try:
                    loading.result()
                except NftError as err:
                    raise NftError(_quoting_lines(str(err), "".join(made))) from None
        finally:
            _libc().malloc_trim(0)

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
        """Names of the named sets (not maps) our table holds."""
        return self._list("sets", SET_LINE) or set()

    def delete_table(self) -> bool:
        try:
            self._context.run(f"delete table {self.table}")
        except NftError:
            return False
        return True


def _feed(writer: int, pieces: Iterable[str], made: list[str]) -> None:
    """Write `pieces` into the pipe, each kept in `made`, then close it. A pipe whose reader is
    gone (nft's parser gave up) takes nothing more: the load's error tells why."""
    try:
        for piece in pieces:
            made.append(piece)
            if not _write(writer, piece.encode()):
                return
    except BaseException:
        _write(writer, UNPARSABLE)
        raise
    finally:
        os.close(writer)


def _write(fd: int, data: bytes) -> bool:
    """Write all of `data`; False when the pipe's reader is gone."""
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:
        return False
    return True


def _quoting_lines(errors: str, text: str) -> str:
    lines = text.split("\n")
    named = sorted({int(number) for number in PIPED_LINE.findall(errors)})[:5]
    quoted = [f"line {n}: {lines[n - 1][:300]}" for n in named if n <= len(lines)]
    return "\n".join([errors, *quoted])


@functools.cache
def _libnftables() -> ctypes.CDLL:
    lib = ctypes.CDLL("libnftables.so.1")
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_char_p
    for name in ("nft_run_cmd_from_buffer", "nft_run_cmd_from_filename"):
        getattr(lib, name).argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    return lib


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc
