"""Talking to the node's packet filter: iptables in the node's flavour, and what the plugin's
rules share with its nftables ones (cni.kernel.nftables): their tags and FirewallError.

The one place that runs the iptables binaries, for the plugin and for knit-proxyd alike (whose
proxyd.iptables.kernel builds on Iptables): flavour detection, iptables-restore, iptables-save
and chain listings, failing with FirewallError. Rules are written as whole transactions
(iptables-restore --noflush; nftables' through libnftables, cni.kernel.nftables) rather than through
python-iptables, which speaks only legacy xtables and appends one rule at a time. Every rule
the plugin writes carries a tag naming its attachment, so DEL and GC find it without saved
state.
"""

from __future__ import annotations

import re
import shutil
import socket
import struct
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cni.kernel.errors import FirewallError

TAG_PATTERN = re.compile(
    r'knit (?P<kind>[^\s"]+) net=(?P<net>[^\s"]+) id=(?P<id>[^\s"]+) if=(?P<ifname>[^\s"]+)'
)
KUBELET_HINT_CHAINS = ("KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY")


@dataclass(frozen=True)
class Tag:
    kind: str
    network: str
    container_id: str
    ifname: str

    def __str__(self) -> str:
        return f"knit {self.kind} net={self.network} id={self.container_id} if={self.ifname}"

    @classmethod
    def parse(cls, text: str) -> Tag | None:
        match = TAG_PATTERN.search(text)
        if match is None:
            return None
        return cls(match["kind"], match["net"], match["id"], match["ifname"])


Selector = Callable[[Tag], bool]


def attachment_selector(kind: str, network: str, container_id: str, ifname: str) -> Selector:
    """Selects the rules of one attachment (DEL, rollback)."""
    return lambda tag: tag == Tag(kind, network, container_id, ifname)


def stale_selector(kind: str, network: str, valid: set[tuple[str, str]]) -> Selector:
    """Selects the network's rules whose attachment is not in the valid list (GC)."""
    return lambda tag: (
        tag.kind == kind and tag.network == network and (tag.container_id, tag.ifname) not in valid
    )


def run(argv: list[str], stdin: str = "") -> str:
    """The binary's output; FirewallError, with the input as details, when it fails."""
    try:
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True, check=False)
    except FileNotFoundError as err:
        raise FirewallError(f"{argv[0]} is not installed") from err
    if proc.returncode != 0:
        raise FirewallError(
            f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.stdout.strip()}", stdin
        )
    return proc.stdout


def _output(binary: str, *args: str) -> str:
    if shutil.which(binary) is None:
        return ""
    proc = subprocess.run([binary, *args], capture_output=True, text=True, check=False)
    return proc.stdout if proc.returncode == 0 else ""


def _legacy_tables(version: int) -> set[str]:
    """The legacy xtables tables of one family that exist in the calling thread's network
    namespace, as the kernel lists them (none when the module was never loaded)."""
    names = "ip_tables_names" if version == 4 else "ip6_tables_names"
    try:
        return set(Path(f"/proc/thread-self/net/{names}").read_text().split())
    except FileNotFoundError:
        return set()


def _mangle_chains(flavour: str) -> set[str]:
    """The chains of the flavour's mangle table: listed with `-S` on nft, whose save of one table
    reads the others too, a nat table kube-proxy filled included
    (docs/benchmarks.md#on-a-crowded-node); saved on legacy, whose `-S` would take the xtables
    lock."""
    if flavour == "legacy":
        saved = _output("iptables-legacy-save", "-t", "mangle").splitlines()
        return {line[1:].split()[0] for line in saved if line.startswith(":")}
    listed = _output("iptables-nft", "-w", "5", "-t", "mangle", "-S").splitlines()
    return {line.split()[1] for line in listed if line.startswith("-N ")}


SO_NETNS_COOKIE = 71
"""Not among the socket module's constants: a network namespace's 64-bit id, never reused
while the machine runs (Linux 5.14 and later)."""
_hinted_flavours: dict[int, str] = {}
"""Network namespace cookie -> the flavour kubelet's hint named there."""


def _netns_cookie() -> int | None:
    """The calling thread's network namespace's cookie; None where the kernel has none."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as probe:
            return int(
                struct.unpack("=Q", probe.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8))[0]
            )
    except OSError:
        return None


def detect_iptables_flavour() -> str:
    """'nft' or 'legacy', decided as kind's node image and iptables-wrappers decide.

    The mode kubelet announced with its hint chains wins; otherwise the flavour that holds
    more rules; a tie (a fresh node) goes to nft. Legacy's mangle table is read only when it
    exists: asking legacy xtables for a table creates it, with hooks every packet then passes.
    """
    # Kubelet makes its hint at start and keeps it, so a hint's answer holds for the
    # namespace's life: the daemon's fast path, serving every call of its node, lists the
    # mangle table once instead of per call, a listing that grows with the node's other rules
    # (docs/benchmarks.md#on-a-crowded-node). An answer from counting rules is not kept:
    # kubelet's hint may come after it.
    cookie = _netns_cookie()
    if cookie is not None and cookie in _hinted_flavours:
        return _hinted_flavours[cookie]
    for flavour in ("nft", "legacy"):
        if flavour == "legacy" and "mangle" not in _legacy_tables(4):
            continue
        if not _mangle_chains(flavour).isdisjoint(KUBELET_HINT_CHAINS):
            if cookie is not None:
                _hinted_flavours[cookie] = flavour
            return flavour
    counts = {}
    for flavour in ("nft", "legacy"):
        text = _output(f"iptables-{flavour}-save") + _output(f"ip6tables-{flavour}-save")
        counts[flavour] = sum(1 for line in text.splitlines() if line.startswith("-"))
    return "legacy" if counts["legacy"] > counts["nft"] else "nft"


def _chain_listing_argv(binary: str, flavour: str, table: str, chain: str) -> list[str]:
    """The command that lists one chain's rules (`binary` is `iptables-nft`,
    `ip6tables-legacy`, ...). On nft, the chain alone: iptables-nft-save of one table reads
    every rule of every table, a nat table kube-proxy filled included, where a chain's listing
    reads that chain (docs/benchmarks.md#on-a-crowded-node). Legacy xtables hands out whole
    tables anyway, and its save, unlike `-S`, takes no lock."""
    if flavour == "legacy":
        return [f"{binary}-save", "-t", table]
    return [binary, "-w", "5", "-t", table, "-S", chain]


def _rules_of_chain(listing: str, chain: str) -> list[str]:
    """The chain's `-A` lines in a listing from _chain_listing_argv."""
    return [line for line in listing.splitlines() if line.startswith(f"-A {chain} ")]


class Iptables:
    """One address family of iptables in the node's flavour (detected when not given)."""

    def __init__(self, family: int, flavour: str | None = None) -> None:
        prefix = "iptables" if family == 4 else "ip6tables"
        self.family = family
        self.flavour = flavour or detect_iptables_flavour()
        self.binary = f"{prefix}-{self.flavour}"
        self.save_binary = f"{prefix}-{self.flavour}-save"
        self.restore_binary = f"{prefix}-{self.flavour}-restore"

    def may_hold_rules(self, table: str) -> bool:
        """False when the table cannot hold rules to remove: this flavour's iptables is not
        installed, or legacy xtables lacks the table (asking for it would create it)."""
        if shutil.which(self.binary) is None:
            return False
        return self.flavour != "legacy" or table in _legacy_tables(self.family)

    def chain_reader(self, table: str) -> Callable[[str], list[str]]:
        """For one look at the table: a chain's rules as iptables-save prints them, each
        listing made once (legacy xtables' one save of the table serves every chain)."""
        listings: dict[tuple[str, ...], str] = {}

        def rules(chain: str) -> list[str]:
            argv = _chain_listing_argv(self.binary, self.flavour, table, chain)
            if tuple(argv) not in listings:
                listings[tuple(argv)] = run(argv)
            return _rules_of_chain(listings[tuple(argv)], chain)

        return rules

    def chain_rules(self, table: str, chain: str) -> list[str]:
        """One chain's rules as iptables-save prints them."""
        return self.chain_reader(table)(chain)

    def save(self, table: str) -> str:
        return run([self.save_binary, "-t", table])

    def restore(self, text: str, test: bool = False) -> None:
        """Load `text` into the tables it names, leaving their other chains; `test`: parse
        and check it, committing nothing."""
        run([self.restore_binary, "--noflush", "-w", "5", *(["--test"] if test else [])], text)
