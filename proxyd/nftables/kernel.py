"""Thin layer over nft: transactions as `nft -f` text, written by nft processes (full syncs)
or by this process's own libnftables context (partial syncs), and the names of what a table
holds (for full syncs).

Why text (see the README's "Why each library"): nft's parser and its compiler to netlink are
the reference implementation of the rule language and a transaction is atomic. Why two ways
to run it: a partial sync is a few elements, which libnftables in this process commits in
~0.5 ms, where an nft process costs ~3 ms to start and, after any transaction that deleted
something, ~10-20 ms more at exit, the kernel closing its netlink socket only after an RCU
grace period; the context stays open for the daemon's life, so it never waits for that. A full
sync is large: nft needs ~300 MiB at 10,000 services, which a process gives back when it ends,
and its chunks load in processes while Python makes the next (see proxier.py).
"""

from __future__ import annotations

import ctypes
import functools
import re
import subprocess
import weakref
from collections.abc import Iterable

from proxyd.nftables.render import TABLE, family_name

CHAIN_LINE = re.compile(r"^\s*chain (\S+) \{", re.MULTILINE)
SET_LINE = re.compile(r"^\s*set (\S+) \{", re.MULTILINE)


class NftError(RuntimeError):
    pass


class Context:
    """A libnftables context of this process: its netlink socket, opened in the calling
    thread's network namespace, stays open until the context is collected."""

    def __init__(self) -> None:
        lib = _libnftables()
        self._handle = lib.nft_ctx_new(0)
        if not self._handle:
            raise NftError("libnftables: no context")
        lib.nft_ctx_buffer_output(self._handle)
        lib.nft_ctx_buffer_error(self._handle)
        weakref.finalize(self, lib.nft_ctx_free, self._handle)

    def run(self, text: str) -> None:
        lib = _libnftables()
        failed = lib.nft_run_cmd_from_buffer(self._handle, text.encode())
        lib.nft_ctx_get_output_buffer(self._handle)  # read, so the buffer starts empty again
        errors = lib.nft_ctx_get_error_buffer(self._handle).decode(errors="replace")
        if failed:
            raise NftError(f"nft transaction failed: {errors.strip()[:2000]}")


class Nft:
    def __init__(self, family: int, table: str = TABLE) -> None:
        self.family = family
        self.table = f"{family_name(family)} {table}"
        self._context: Context | None = None

    def run_here(self, text: str) -> None:
        """One transaction through this process's libnftables context, opened by the first
        call in the namespace the calling thread is in then."""
        if not text:
            return
        if self._context is None:
            self._context = Context()
        self._context.run(text)

    def run(self, text: str) -> None:
        """One transaction through an nft process."""
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

    def _list(self, what: str, pattern: re.Pattern[str]) -> set[str] | None:
        proc = subprocess.run(
            ["nft", "--terse", "list", what, family_name(self.family)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise NftError(f"nft list {what} failed: {proc.stderr.strip()}")
        for block in proc.stdout.split("\ntable "):
            header = block.lstrip().removeprefix("table ").split(" {", 1)[0]
            if header == self.table:
                return set(pattern.findall(block))
        return None

    def chains(self) -> set[str] | None:
        """Names of the chains our table holds; None when the table does not exist (the
        listing names every table of the family, even one without chains)."""
        return self._list("chains", CHAIN_LINE)

    def sets(self) -> set[str]:
        """Names of the named sets (not maps) our table holds; --terse leaves out their
        elements (100,000 hairpin entries at 10,000 services)."""
        return self._list("sets", SET_LINE) or set()

    def delete_table(self) -> bool:
        proc = subprocess.run(
            ["nft", "delete", "table", *self.table.split()], capture_output=True, check=False
        )
        return proc.returncode == 0


@functools.cache
def _libnftables() -> ctypes.CDLL:
    lib = ctypes.CDLL("libnftables.so.1")
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    for name in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
    for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
        getattr(lib, name).argtypes = [ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_char_p
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    return lib


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
