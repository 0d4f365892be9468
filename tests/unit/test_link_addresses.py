"""The addresses as cni.kernel.addresses reads a dump, the kernel's side scripted (the kernel tests
read real dumps): one link's asked of the kernel by index on a strict-checking socket and
picked on reading as well (a kernel before 4.20 sends every link's), the families asked for,
the local end of a point-to-point address, prefix lengths and scopes."""

from __future__ import annotations

import socket

import pytest

from cni.kernel import addresses
from cni.kernel.addresses import IFA_ADDRESS, IFA_LOCAL, IFADDRMSG, RTM_NEWADDR, LinkAddress
from cni.kernel.rawnetlink import (
    DONE,
    ERROR_CODE,
    HEADER,
    NETLINK_GET_STRICT_CHK,
    SOL_NETLINK,
    attribute,
)
from tests.support.netlink_script import ScriptedKernel, message, scripted


def address(family: int, link: int, prefix: int, scope: int, *attrs: tuple[int, str]) -> bytes:
    packed = b"".join(attribute(kind, socket.inet_pton(family, a)) for kind, a in attrs)
    return IFADDRMSG.pack(family, prefix, 0, scope, link) + packed


EVERY_LINKS = [
    address(socket.AF_INET, 1, 8, 254, (IFA_ADDRESS, "127.0.0.1"), (IFA_LOCAL, "127.0.0.1")),
    address(socket.AF_INET, 2, 24, 0, (IFA_ADDRESS, "192.0.2.1"), (IFA_LOCAL, "192.0.2.1")),
    address(socket.AF_INET, 2, 32, 0, (IFA_ADDRESS, "203.0.113.2"), (IFA_LOCAL, "203.0.113.1")),
    address(socket.AF_INET6, 2, 64, 0, (IFA_ADDRESS, "2001:db8::1")),
    address(socket.AF_INET6, 2, 64, 253, (IFA_ADDRESS, "fe80::1")),
    address(socket.AF_INET6, 3, 128, 0, (IFA_ADDRESS, "fd00::3")),
]


@pytest.fixture
def kernel(monkeypatch: pytest.MonkeyPatch) -> ScriptedKernel:
    """A kernel that sends every link's addresses of both families, whatever is asked."""
    scripted_kernel = ScriptedKernel(
        lambda seq: [
            b"".join(message(RTM_NEWADDR, seq, a) for a in EVERY_LINKS),
            message(DONE, seq, ERROR_CODE.pack(0)),
        ]
    )
    monkeypatch.setattr(addresses, "NetlinkSocket", lambda _: scripted(scripted_kernel))
    return scripted_kernel


def asked(kernel: ScriptedKernel) -> tuple[int, int]:
    """The family and link index of the dump request sent."""
    family, _, _, _, index = IFADDRMSG.unpack_from(kernel.sent[0], HEADER.size)
    return family, index


def test_one_links_addresses_are_asked_by_index_and_picked_on_reading(
    kernel: ScriptedKernel,
) -> None:
    assert addresses.link_addresses(index=2) == [
        LinkAddress(2, "192.0.2.1", 24, 0),
        LinkAddress(2, "203.0.113.1", 32, 0),
        LinkAddress(2, "2001:db8::1", 64, 0),
        LinkAddress(2, "fe80::1", 64, 253),
    ]
    assert asked(kernel) == (socket.AF_UNSPEC, 2)
    assert kernel.options == [(SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)]


def test_every_links_addresses_of_a_family(kernel: ScriptedKernel) -> None:
    found = addresses.link_addresses(6)
    assert [(a.link, a.address) for a in found] == [
        (2, "2001:db8::1"),
        (2, "fe80::1"),
        (3, "fd00::3"),
    ]
    assert asked(kernel) == (socket.AF_INET6, 0)
    assert kernel.options == [], "a dump of every link's is not checked strictly"
