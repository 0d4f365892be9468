"""macspoofchk: frames entering the bridge from a pod's veth must carry the pod's MAC."""

from __future__ import annotations

from cni.kernel.firewall import Selector, Tag
from cni.kernel.nftables import nft_apply, nft_tagged_rules

KIND = "spoofchk"
TABLE = "knit_spoofchk"
CHAIN = "prerouting"


def setup(tag: Tag, host_veth: str, mac: str) -> None:
    nft_apply(
        f"add table bridge {TABLE}\n"
        f"add chain bridge {TABLE} {CHAIN} "
        "{ type filter hook prerouting priority -300; policy accept; }\n"
        f'add rule bridge {TABLE} {CHAIN} iifname "{host_veth}" ether saddr != {mac} drop '
        f'comment "{tag}"\n'
    )


def teardown(select: Selector) -> None:
    handles = [h for h, tag in nft_tagged_rules("bridge", TABLE, CHAIN) if select(tag)]
    if handles:
        nft_apply("".join(f"delete rule bridge {TABLE} {CHAIN} handle {h}\n" for h in handles))
