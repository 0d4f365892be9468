"""nftables for the plugin and knit-proxyd alike: libnftables, the library behind the `nft`
command, driven in this process through ctypes. No nft processes are run.

A Context is a libnftables context: it takes commands in nft's text language, each buffer one
atomic transaction, and returns what they printed. Its netlink socket is opened in the network
namespace the calling thread is in when the context is made, and stays bound to it. So the
plugin's rules (nft_apply, nft_tagged_rules) open a context per call, in whatever namespace
the call has entered; knit-proxyd keeps one per family open (proxyd.nftables.kernel).

The library is loaded on first use, not on import: the plugin is exec'd per call and most calls
never touch nftables. KNIT_LIBNFTABLES names another library to load (a path or a soname).
Every failure (the library missing, the kernel unreachable, a command refused) is an NftError,
a FirewallError: the plugin answers it with code 103.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import socket
import weakref
from typing import Any

from cni.kernel.errors import FirewallError
from cni.kernel.firewall import Tag
from cni.kernel.rawnetlink import NETLINK_NETFILTER

LIBRARY_ENV = "KNIT_LIBNFTABLES"
LIBRARY = "libnftables.so.1"
OUTPUT_JSON = 1 << 4
"""libnftables' NFT_CTX_OUTPUT_JSON: listings in JSON, as `nft -j` prints them."""
OUTPUT_TERSE = 1 << 11
"""libnftables' NFT_CTX_OUTPUT_TERSE: listings leave out set elements (and nft does not fetch
them: 100,000 hairpin entries at 10,000 services)."""


class NftError(FirewallError):
    """libnftables cannot be loaded or reach the kernel, or refused a command (the plugin
    reports code 103); details hold the commands refused."""


class Context:
    """A libnftables context, its netlink socket opened in the calling thread's network
    namespace. Freed by close (or the end of a with block), else when collected.

    libnftables ends the process when it cannot open that socket, as it ends an nft process,
    and a plugin so ended would answer nothing: one is opened here first, so that failure is
    an NftError. Only running out of memory, or another thread taking the last descriptor
    between the two, still ends the process."""

    def __init__(self, output_flags: int = OUTPUT_TERSE) -> None:
        lib = _libnftables()
        try:
            socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER).close()
        except OSError as err:
            raise NftError(f"cannot open a netfilter netlink socket: {err}") from err
        self._handle = lib.nft_ctx_new(0)
        lib.nft_ctx_output_set_flags(self._handle, output_flags)
        lib.nft_ctx_buffer_output(self._handle)
        lib.nft_ctx_buffer_error(self._handle)
        self._free = weakref.finalize(self, lib.nft_ctx_free, self._handle)

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Free the context and close its socket now; it is not to be used after."""
        self._free()

    def run(self, text: str) -> str:
        """Run nft commands (one transaction); returns what they printed."""
        lib = _libnftables()
        failed = lib.nft_run_cmd_from_buffer(self._handle, text.encode())
        output: str = lib.nft_ctx_get_output_buffer(self._handle).decode(errors="replace")
        errors = lib.nft_ctx_get_error_buffer(self._handle).decode(errors="replace")
        if failed:
            raise NftError(f"nft transaction failed: {errors.strip()[:2000]}", text)
        return output

    def rehearse(self, text: str) -> None:
        """Parse, check and encode the commands as run would, sending nothing to the kernel
        (nft's dry run). A process's first transaction costs more CPU than the same one run
        again (nft's code paged in, its cache and memory grown); a rehearsal pays that ahead
        of a transaction that is waited for (docs/benchmarks.md#networkpolicy-make-bench-policy)."""
        lib = _libnftables()
        lib.nft_ctx_set_dry_run(self._handle, True)
        try:
            self.run(text)
        finally:
            lib.nft_ctx_set_dry_run(self._handle, False)


def nft_apply(script: str) -> None:
    """Run the plugin's nft commands as one transaction, in the calling thread's namespace."""
    with Context() as context:
        context.run(script)


def nft_tagged_rules(family: str, table: str, chain: str) -> list[tuple[int, Tag]]:
    """(handle, tag) of every tagged rule in the chain, in the calling thread's namespace;
    empty when the chain cannot be listed (its table is absent, libnftables is missing)."""
    try:
        with Context(OUTPUT_JSON) as context:
            listing = context.run(f"list chain {family} {table} {chain}")
    except NftError:
        return []
    found = []
    for item in json.loads(listing).get("nftables", []):
        rule: dict[str, Any] = item.get("rule") or {}
        tag = Tag.parse(rule.get("comment", ""))
        if tag is not None:
            found.append((int(rule["handle"]), tag))
    return found


def malloc_trim() -> None:
    """Give the memory nft freed back to the system, as a process would by ending (glibc keeps
    what a large transaction freed)."""
    _libc().malloc_trim(0)


def _libnftables() -> ctypes.CDLL:
    name = os.environ.get(LIBRARY_ENV, LIBRARY)
    try:
        return _load(name)
    except (OSError, AttributeError) as err:  # not found, or a library without nft's functions
        raise NftError(f"cannot load libnftables ({name}): {err}") from err


@functools.cache
def _load(name: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(name)
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
    lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    for function in ("nft_ctx_buffer_output", "nft_ctx_buffer_error"):
        getattr(lib, function).argtypes = [ctypes.c_void_p]
    for function in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
        getattr(lib, function).argtypes = [ctypes.c_void_p]
        getattr(lib, function).restype = ctypes.c_char_p
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_ctx_set_dry_run.argtypes = [ctypes.c_void_p, ctypes.c_bool]
    return lib


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None)
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    return libc
