"""Thin layer over the kernel's ipsets (pyroute2): create knit's sets, add and delete
members, refill a set atomically (fill a scratch set, swap), and destroy them all.

Members are the text `ipset` itself writes ("10.96.0.10,tcp:80", "30080").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

from pyroute2.ipset import IPSet, NoSuchObject, PortEntry

from cni.kernel.families import ADDRESS_FAMILIES
from proxyd.ipvs import names
from proxyd.ipvs.names import SetSpec
from proxyd.ipvs.netlink import PROTOCOL_NUMBERS

PROTOCOLS_BY_NAME = {name.lower(): number for name, number in PROTOCOL_NUMBERS.items()}
MAX_ELEMENTS = 1 << 20


def entry_of(spec: SetSpec, text: str) -> tuple[Any, str]:
    """(pyroute2 entry, etype) for a member written as `ipset` writes it."""
    etype = spec.type.split(":", 1)[1]
    if etype == "port":
        return int(text), etype
    parts: list[Any] = []
    for kind, value in zip(etype.split(","), text.split(","), strict=True):
        if kind == "port":
            proto, number = value.split(":")
            parts.append(PortEntry(int(number), PROTOCOLS_BY_NAME[proto]))
        else:
            parts.append(value)
    return (tuple(parts) if len(parts) > 1 else parts[0]), etype


class Ipsets:
    def __init__(self, family: int) -> None:
        self.family = family
        self.af = ADDRESS_FAMILIES[family]

    def _create(self, ipset: IPSet, name: str, spec: SetSpec) -> None:
        options: dict[str, Any] = {"family": self.af, "exclusive": False}
        if spec.type == "bitmap:port":
            options["bitmap_ports_range"] = (0, 65535)
        else:
            options["maxelem"] = MAX_ELEMENTS
        ipset.create(name, stype=spec.type, **options)

    def ensure(self) -> None:
        """Create every set of the family that does not exist yet."""
        with IPSet() as ipset:
            for spec in names.SETS:
                self._create(ipset, names.set_name(spec.key, self.family), spec)

    def update(self, added: list[tuple[str, str]], removed: list[tuple[str, str]]) -> None:
        """Add and delete members ((set key, entry)); adding one twice or deleting a missing
        one is no error."""
        if not added and not removed:
            return
        with IPSet() as ipset:
            for key, text in removed:
                spec = names.SETS_BY_KEY[key]
                entry, etype = entry_of(spec, text)
                ipset.delete(
                    names.set_name(key, self.family), entry, self.af, exclusive=False, etype=etype
                )
            for key, text in added:
                spec = names.SETS_BY_KEY[key]
                entry, etype = entry_of(spec, text)
                ipset.add(
                    names.set_name(key, self.family), entry, self.af, exclusive=False, etype=etype
                )

    def replace(self, spec: SetSpec, entries: list[str]) -> None:
        """Make the set hold exactly `entries`, atomically: fill a scratch set, swap, destroy."""
        scratch = names.swap_name(self.family)
        with IPSet() as ipset:
            with contextlib.suppress(NoSuchObject):
                ipset.destroy(scratch)
            self._create(ipset, scratch, spec)
            for text in entries:
                entry, etype = entry_of(spec, text)
                ipset.add(scratch, entry, self.af, exclusive=False, etype=etype)
            ipset.swap(names.set_name(spec.key, self.family), scratch)
            ipset.destroy(scratch)

    def ports(self, keys: Iterable[str]) -> dict[str, set[int]]:
        """The ports in each of the bitmap:port sets, read through one socket; none for a set
        that does not exist."""
        found: dict[str, set[int]] = {}
        with IPSet() as ipset:
            for key in keys:
                try:
                    messages = list(ipset.list(names.set_name(key, self.family)))
                except NoSuchObject:
                    messages = []
                found[key] = {
                    data.get_attr("IPSET_ATTR_PORT_FROM")
                    for message in messages
                    if (adt := message.get_attr("IPSET_ATTR_ADT")) is not None
                    for data in adt.get_attrs("IPSET_ATTR_DATA")
                }
        return found


def destroy_owned() -> int:
    """Destroy every KNIT-/KNIT6- set (iptables rules must not use them any more)."""
    with IPSet() as ipset:
        owned = sorted(
            {
                name
                for message in ipset.list()
                if names.owned_set(name := message.get_attr("IPSET_ATTR_SETNAME"))
            }
        )
        for name in owned:
            ipset.destroy(name)
    return len(owned)
