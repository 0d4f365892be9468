"""The plugin's links through rawnetlink, one request each, encoded and read with struct
(through pyroute2 each request's answer was decoded whole into objects, and a pod's ADD makes
seven: docs/benchmarks.md#plain): look up, create, set and delete links, a bridge port's
hairpin and VLAN settings, a link's global addresses and their changes; netlink errors turned
into CNI ones. Each works in the calling thread's network namespace."""

from __future__ import annotations

import _socket  # not socket: see cni.kernel.rawnetlink
import errno
import ipaddress
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from cni.errors import CniError, Code
from cni.kernel.addresses import IFA_ADDRESS, IFA_LOCAL, IFADDRMSG, link_addresses
from cni.kernel.families import ADDRESS_FAMILIES
from cni.kernel.rawnetlink import CREATE_NEW, U32, RawNetlinkError, attribute, attributes, request
from cni.record import Record
from cni.result import IPAddress, IPInterface

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK, RTM_SETLINK = 16, 17, 18, 19
RTM_NEWADDR, RTM_DELADDR = 20, 21
RTM_DELNEIGH = 29
NDMSG = struct.Struct("=BxxxiHBB")
"""ndmsg: family, interface index, state, flags, type."""
NDA_DST = 1
IFINFOMSG = struct.Struct("=BxHiII")
"""ifinfomsg: family, device type, index, flags, change mask."""
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU, IFLA_MASTER = 1, 3, 4, 10
IFLA_PROTINFO, IFLA_LINKINFO, IFLA_AF_SPEC, IFLA_NET_NS_FD = 12, 18, 26, 28
IFLA_INFO_KIND, IFLA_INFO_DATA, IFLA_INFO_SLAVE_DATA = 1, 2, 5
VETH_INFO_PEER = 1
IFLA_BR_VLAN_FILTERING = 7
IFLA_BRPORT_STATE, IFLA_BRPORT_MODE = 1, 4
"""A bridge port's STP state (IFLA_INFO_SLAVE_DATA of its link) and hairpin mode (IFLA_PROTINFO
of an AF_BRIDGE request)."""
BR_STATE_DISABLED = 0
IFLA_BRIDGE_VLAN_INFO = 2
BRIDGE_VLAN_INFO = struct.Struct("=HH")
"""bridge_vlan_info: flags, VLAN id."""
BRIDGE_VLAN_INFO_PVID = 0x2
IFF_UP, IFF_PROMISC = 0x1, 0x100
U8 = struct.Struct("=B")


class Link(Record):
    __slots__ = ("flags", "index", "kind", "mac", "master", "mtu", "name")

    def __init__(
        self, index: int, name: str, kind: str, mac: str, mtu: int, master: int | None, flags: int
    ) -> None:
        self.index = index
        self.name = name
        self.kind = kind
        self.mac = mac
        self.mtu = mtu
        self.master = master
        self.flags = flags


@contextmanager
def netlink_errors(action: str) -> Iterator[None]:
    try:
        yield
    except RawNetlinkError as err:
        raise CniError(Code.NETLINK_FAILURE, f"{action}: {err}") from err


def ignoring(code: int, call: Callable[[], Any]) -> None:
    """Run a netlink call for which one errno (EEXIST, ENODEV, ...) means "already done"."""
    try:
        call()
    except RawNetlinkError as err:
        if err.errno != code:
            raise


def _request(kind: int, body: bytes, flags: int = 0) -> list[tuple[int, memoryview]]:
    return request(_socket.NETLINK_ROUTE, kind, body, flags)


def link_by_name(name: str) -> Link | None:
    """The link of that name, or None."""
    try:
        replies = _request(RTM_GETLINK, _named(name))
    except RawNetlinkError as err:
        if err.errno == errno.ENODEV:
            return None
        raise CniError(Code.NETLINK_FAILURE, f"cannot look up {name}: {err}") from err
    for kind, payload in replies:
        if kind == RTM_NEWLINK and len(payload) >= IFINFOMSG.size:
            return _link(payload)
    return None


def port_state(name: str) -> int | None:
    """The STP state (BR_STATE_*) of the bridge port of that name; None when it is no port."""
    for kind, payload in _request(RTM_GETLINK, _named(name)):
        if kind == RTM_NEWLINK and len(payload) >= IFINFOMSG.size:
            found = attributes(payload[IFINFOMSG.size :])
            info = attributes(found.get(IFLA_LINKINFO, memoryview(b"")))
            port = attributes(info.get(IFLA_INFO_SLAVE_DATA, memoryview(b"")))
            state = port.get(IFLA_BRPORT_STATE)
            return U8.unpack(state)[0] if state is not None else None
    return None


def delete_link(name: str) -> bool:
    """Remove the link of that name (a veth: both ends); False when there was none."""
    try:
        _request(RTM_DELLINK, _named(name))
    except RawNetlinkError as err:
        if err.errno == errno.ENODEV:
            return False
        raise CniError(Code.NETLINK_FAILURE, f"cannot delete {name}: {err}") from err
    return True


def create_bridge(name: str, vlan_filtering: bool) -> None:
    data = attribute(IFLA_BR_VLAN_FILTERING, U8.pack(1)) if vlan_filtering else b""
    info = attribute(IFLA_INFO_KIND, b"bridge") + attribute(IFLA_INFO_DATA, data, nested=True)
    _request(RTM_NEWLINK, _named(name) + attribute(IFLA_LINKINFO, info, nested=True), CREATE_NEW)


def create_veth(name: str, peer: str, peer_netns_fd: int, mtu: int, peer_mac: str) -> None:
    """A veth pair: `name` here, `peer` in the namespace of peer_netns_fd (mtu 0: the
    kernel's; peer_mac "": the kernel's)."""
    mtu_attribute = attribute(IFLA_MTU, U32.pack(mtu)) if mtu else b""
    peer_body = _named(peer) + attribute(IFLA_NET_NS_FD, U32.pack(peer_netns_fd)) + mtu_attribute
    if peer_mac:
        peer_body += attribute(IFLA_ADDRESS, bytes.fromhex(peer_mac.replace(":", "")))
    data = attribute(VETH_INFO_PEER, peer_body, nested=True)
    info = attribute(IFLA_INFO_KIND, b"veth") + attribute(IFLA_INFO_DATA, data, nested=True)
    body = _named(name) + mtu_attribute + attribute(IFLA_LINKINFO, info, nested=True)
    _request(RTM_NEWLINK, body, CREATE_NEW)


def set_link(
    index: int,
    *,
    up: bool = False,
    promisc: bool = False,
    master: int = 0,
    mtu: int = 0,
    mac: str = "",
) -> None:
    """Turn flags on (up, promiscuous), attach to a master, change the MTU, set the MAC: one
    request."""
    flags = (IFF_UP if up else 0) | (IFF_PROMISC if promisc else 0)
    body = IFINFOMSG.pack(_socket.AF_UNSPEC, 0, index, flags, flags)
    if master:
        body += attribute(IFLA_MASTER, U32.pack(master))
    if mtu:
        body += attribute(IFLA_MTU, U32.pack(mtu))
    if mac:
        body += attribute(IFLA_ADDRESS, bytes.fromhex(mac.replace(":", "")))
    _request(RTM_NEWLINK, body)


def set_hairpin(index: int) -> None:
    """Let the bridge send a port's frames back out of that port (a pod reaching itself
    through a service)."""
    header = IFINFOMSG.pack(_socket.AF_BRIDGE, 0, index, 0, 0)
    protinfo = attribute(IFLA_BRPORT_MODE, U8.pack(1))
    _request(RTM_SETLINK, header + attribute(IFLA_PROTINFO, protinfo, nested=True))


def set_port_vlan(index: int, vlan: int) -> None:
    """The port's frames untagged on the bridge's `vlan` (its PVID), out of the default VLAN 1."""
    header = IFINFOMSG.pack(_socket.AF_BRIDGE, 0, index, 0, 0)
    for kind, flags, vid in ((RTM_SETLINK, BRIDGE_VLAN_INFO_PVID, vlan), (RTM_DELLINK, 0, 1)):
        info = attribute(IFLA_BRIDGE_VLAN_INFO, BRIDGE_VLAN_INFO.pack(flags, vid))
        _request(kind, header + attribute(IFLA_AF_SPEC, info, nested=True))


def _named(name: str) -> bytes:
    """A link request's body naming the link (index 0: the kernel looks the name up)."""
    header = IFINFOMSG.pack(_socket.AF_UNSPEC, 0, 0, 0, 0)
    return header + attribute(IFLA_IFNAME, name.encode() + b"\0")


def _link(payload: memoryview) -> Link:
    _, _, index, flags, _ = IFINFOMSG.unpack_from(payload)
    found = attributes(payload[IFINFOMSG.size :])
    info = attributes(found[IFLA_LINKINFO]) if IFLA_LINKINFO in found else {}
    master = found.get(IFLA_MASTER)
    mtu = found.get(IFLA_MTU)
    return Link(
        index=index,
        name=_string(found.get(IFLA_IFNAME)),
        kind=_string(info.get(IFLA_INFO_KIND)),
        mac=":".join(f"{byte:02x}" for byte in found.get(IFLA_ADDRESS, b"")),
        mtu=U32.unpack(mtu)[0] if mtu is not None else 0,
        master=U32.unpack(master)[0] if master is not None else None,
        flags=flags,
    )


def _string(payload: memoryview | None) -> str:
    return bytes(payload or b"").rstrip(b"\0").decode(errors="replace")


def addresses(index: int) -> list[IPInterface]:
    """The global addresses (scope 0) of a link in the calling thread's network namespace, both
    families, with their prefix lengths (a point-to-point address: its own end, not the
    peer's)."""
    return [
        ipaddress.ip_interface(f"{a.address}/{a.prefix_length}")
        for a in link_addresses(index=index)
        if a.scope == 0
    ]


def add_address(index: int, interface: IPInterface) -> None:
    _address_request(RTM_NEWADDR, index, interface, CREATE_NEW)


def delete_address(index: int, interface: IPInterface) -> None:
    _address_request(RTM_DELADDR, index, interface)


def delete_neighbour(index: int, address: IPAddress) -> None:
    """Remove the link's neighbour entry for the address, and with it the packets queued for
    its resolution; none there is no error."""
    body = NDMSG.pack(ADDRESS_FAMILIES[address.version], index, 0, 0, 0) + attribute(
        NDA_DST, address.packed
    )
    ignoring(errno.ENOENT, lambda: _request(RTM_DELNEIGH, body))


def _address_request(kind: int, index: int, interface: IPInterface, flags: int = 0) -> None:
    family = ADDRESS_FAMILIES[interface.version]
    header = IFADDRMSG.pack(family, interface.network.prefixlen, 0, 0, index)
    packed = interface.ip.packed
    _request(kind, header + attribute(IFA_LOCAL, packed) + attribute(IFA_ADDRESS, packed), flags)
