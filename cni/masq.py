"""ipMasq: source NAT for traffic a pod sends outside its own subnet.

iptables backend: a chain per attachment (KNIT-MASQ-<hash>) reached from nat POSTROUTING
by the pod's source address, as the reference bridge plugin lays it out. nftables backend:
one tagged rule per pod address in `inet knit_masq` postrouting, written through libnftables
(cni.kernel.nftables).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Iterable

from cni.kernel.firewall import Iptables, Selector, Tag, detect_iptables_flavour
from cni.kernel.nftables import nft_apply, nft_tagged_rules
from cni.result import IPInterface

KIND = "masq"
CHAIN_PREFIX = "KNIT-MASQ-"
NFT_TABLE = "knit_masq"
NFT_CHAIN = "postrouting"
MULTICAST = {4: "224.0.0.0/4", 6: "ff00::/8"}


def chain_name(tag: Tag) -> str:
    digest = hashlib.sha256(f"{tag.network}/{tag.container_id}/{tag.ifname}".encode())
    return CHAIN_PREFIX + digest.hexdigest()[:16]


def _by_family(addresses: Iterable[IPInterface]) -> dict[int, list[IPInterface]]:
    by_family: dict[int, list[IPInterface]] = {}
    for address in addresses:
        by_family.setdefault(address.version, []).append(address)
    return by_family


def setup(backend: str, tag: Tag, addresses: Iterable[IPInterface]) -> None:
    by_family = _by_family(addresses)
    if backend == "nftables":
        _nft_setup(tag, by_family)
        return
    flavour = detect_iptables_flavour()
    chain = chain_name(tag)
    for version, family_addresses in by_family.items():
        lines = ["*nat", f":{chain} - [0:0]"]
        for address in family_addresses:
            lines += [
                f'-A {chain} -d {address.network} -m comment --comment "{tag}" -j ACCEPT',
                f'-A {chain} ! -d {MULTICAST[version]} -m comment --comment "{tag}" -j MASQUERADE',
                f'-A POSTROUTING -s {address.ip} -m comment --comment "{tag}" -j {chain}',
            ]
        Iptables(version, flavour).restore("\n".join([*lines, "COMMIT", ""]))


def _nft_setup(tag: Tag, by_family: dict[int, list[IPInterface]]) -> None:
    lines = [
        f"add table inet {NFT_TABLE}",
        f"add chain inet {NFT_TABLE} {NFT_CHAIN} "
        "{ type nat hook postrouting priority srcnat; policy accept; }",
    ]
    for version, family_addresses in by_family.items():
        proto = "ip" if version == 4 else "ip6"
        for address in family_addresses:
            lines.append(
                f"add rule inet {NFT_TABLE} {NFT_CHAIN} {proto} saddr {address.ip} "
                f"{proto} daddr != {address.network} {proto} daddr != {MULTICAST[version]} "
                f'masquerade comment "{tag}"'
            )
    nft_apply("\n".join(lines) + "\n")


def teardown(backends: Iterable[str], select: Selector, families: Collection[int]) -> None:
    """Remove the selected masquerade rules from the given backends and address families.

    A backend or family that cannot hold rules (not installed, its table never made) has none
    to remove: DEL and GC must not fail on what the attachment never used.
    """
    if "nftables" in backends:
        handles = _nft_handles(select)
        if handles:
            nft_apply(
                "".join(f"delete rule inet {NFT_TABLE} {NFT_CHAIN} handle {h}\n" for h in handles)
            )
    if "iptables" in backends and families:
        flavour = detect_iptables_flavour()
        for version in families:
            iptables = Iptables(version, flavour)
            if iptables.may_hold_rules("nat"):
                _iptables_teardown(iptables, select)


def present(backend: str, select: Selector, addresses: Collection[IPInterface]) -> bool:
    """Whether the backend holds the selected attachment's masquerade rules for these pod
    addresses: a tagged rule per address in nftables; in iptables, per address of each family,
    a tagged POSTROUTING jump and a tagged MASQUERADE rule in that family's nat table."""
    if backend == "nftables":
        return len(_nft_handles(select)) >= len(addresses)
    flavour = detect_iptables_flavour()
    for version, family_addresses in _by_family(addresses).items():
        iptables = Iptables(version, flavour)
        if not iptables.may_hold_rules("nat"):
            return False
        chain_rules = iptables.chain_reader("nat")
        jumps = _jumps(chain_rules, select)
        masquerades = [
            line
            for chain in {_target(jump) for jump in jumps}
            for line in _selected(chain_rules(chain), select, _is_masq)
        ]
        if min(len(jumps), len(masquerades)) < len(family_addresses):
            return False
    return True


def _nft_handles(select: Selector) -> list[int]:
    return [h for h, tag in nft_tagged_rules("inet", NFT_TABLE, NFT_CHAIN) if select(tag)]


def _selected(rules: list[str], select: Selector, kind: Callable[[str], bool]) -> list[str]:
    """The rules of this kind whose tag the selector picks."""
    return [rule for rule in rules if kind(rule) and (tag := Tag.parse(rule)) and select(tag)]


def _jumps(chain_rules: Callable[[str], list[str]], select: Selector) -> list[str]:
    """The selected attachments' entries: their jumps from nat POSTROUTING."""
    return _selected(chain_rules("POSTROUTING"), select, _is_jump)


def _target(jump: str) -> str:
    return jump.rsplit("-j ", 1)[1].strip()


def _is_jump(line: str) -> bool:
    """An attachment's entry: the jump from POSTROUTING to its chain."""
    return line.startswith("-A POSTROUTING ") and f"-j {CHAIN_PREFIX}" in line


def _is_masq(line: str) -> bool:
    return line.endswith(" -j MASQUERADE")


def _iptables_teardown(iptables: Iptables, select: Selector) -> None:
    jumps = _jumps(iptables.chain_reader("nat"), select)
    chains = {_target(line) for line in jumps}
    if jumps:
        flushes = [f":{c} - [0:0]" for c in sorted(chains)]
        removals = [f"-X {c}" for c in sorted(chains)]
        deletions = ["-D" + line[2:] for line in jumps]
        iptables.restore("\n".join(["*nat", *flushes, *deletions, *removals, "COMMIT", ""]))
