"""Thin layer over IPVS's generic netlink family (pyroute2): read, add, change and delete
virtual and real servers.

Real servers use NAT forwarding (masquerading), weight 1; ClientIP affinity is IPVS
persistence with the affinity timeout and a full-length netmask.
"""

from __future__ import annotations

import contextlib
import errno
import socket
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from pyroute2 import IPVS, IPVSDest, IPVSService
from pyroute2.netlink.exceptions import NetlinkError

from cni.kernel.families import ADDRESS_FAMILIES
from proxyd.ipvs.desired import Frontend, RealServer, VirtualServer
from proxyd.model import family_of

PROTOCOL_NUMBERS = {"TCP": socket.IPPROTO_TCP, "UDP": socket.IPPROTO_UDP, "SCTP": 132}
PROTOCOL_NAMES = {number: name for name, number in PROTOCOL_NUMBERS.items()}
FLAG_PERSISTENT = 0x1
FORWARD_MASQ = 0
SYSCTLS = (
    "net/ipv4/vs/conntrack",
    "net/ipv4/vs/expire_nodest_conn",
    "net/ipv4/vs/expire_quiescent_template",
)
"""Set to 1: let iptables masquerade IPVS traffic; drop connections of deleted real servers;
let persistence templates of weight-0 real servers expire. They exist once ip_vs is loaded."""


class IpvsUnavailable(RuntimeError):
    pass


class IpvsSocket(Protocol):
    """What the kernel wrapper uses of pyroute2.IPVS."""

    def service(self, command: str, service: Any = None) -> Any: ...

    def dest(self, command: str, service: Any, dest: Any = None) -> Any: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class ServiceInfo:
    scheduler: str
    timeout: int


@dataclass(frozen=True)
class DestInfo:
    weight: int
    active: int
    inactive: int


def open_socket() -> IPVS:
    try:
        return IPVS()
    except NetlinkError as err:
        if err.code == errno.ENOENT:
            raise IpvsUnavailable(
                "IPVS is not available in this kernel (no IPVS generic netlink family;"
                " load the ip_vs module or build with CONFIG_IP_VS)"
            ) from err
        raise


def ipvs_loaded() -> bool:
    """Whether this namespace has IPVS (the kernel's ip_vs is loaded)."""
    return Path("/proc/net/ip_vs").exists()


def load_module() -> None:
    """Ask for IPVS's generic netlink family once, which loads the ip_vs module (Linux 5.16
    and later) and so creates the SYSCTLS; nothing happens without IPVS (syncs say so)."""
    with contextlib.suppress(IpvsUnavailable, NetlinkError):
        open_socket().close()


def _family(address: str) -> int:
    return ADDRESS_FAMILIES[family_of(address)]


def _netmask(family: int) -> str:
    """The kernel reads the netmask attribute raw: an IPv4 mask, or an IPv6 prefix length
    as a host-order u32."""
    if family == socket.AF_INET:
        return "255.255.255.255"
    return socket.inet_ntoa(struct.pack("=I", 128))


def service_key(frontend: Frontend) -> IPVSService:
    return IPVSService(
        af=_family(frontend.address),
        addr=frontend.address,
        port=frontend.port,
        protocol=PROTOCOL_NUMBERS[frontend.protocol],
    )


def service_request(server: VirtualServer) -> IPVSService:
    frontend = server.frontend
    family = _family(frontend.address)
    return IPVSService(
        af=family,
        addr=frontend.address,
        port=frontend.port,
        protocol=PROTOCOL_NUMBERS[frontend.protocol],
        sched_name=server.scheduler,
        timeout=server.timeout,
        flags={"flags": FLAG_PERSISTENT if server.timeout else 0, "mask": 0xFFFFFFFF},
        netmask=_netmask(family),
    )


def dest_request(real: RealServer, weight: int) -> IPVSDest:
    return IPVSDest(
        addr=real.ip,
        addr_family=_family(real.ip),
        port=real.port,
        fwd_method=FORWARD_MASQ,
        weight=weight,
    )


def parse_service(message: Any) -> tuple[Frontend, ServiceInfo] | None:
    """None for firewall-mark services and unknown protocols."""
    attrs = message.get("IPVS_CMD_ATTR_SERVICE")
    address = attrs.get("IPVS_SVC_ATTR_ADDR")
    protocol = PROTOCOL_NAMES.get(attrs.get("IPVS_SVC_ATTR_PROTOCOL"))
    if attrs.get("IPVS_SVC_ATTR_FWMARK") or address is None or protocol is None:
        return None
    frontend = Frontend(address, protocol, attrs.get("IPVS_SVC_ATTR_PORT"))
    flags = attrs.get("IPVS_SVC_ATTR_FLAGS")["flags"]
    timeout = attrs.get("IPVS_SVC_ATTR_TIMEOUT") if flags & FLAG_PERSISTENT else 0
    return frontend, ServiceInfo(attrs.get("IPVS_SVC_ATTR_SCHED_NAME"), timeout)


def parse_dest(message: Any) -> tuple[RealServer, DestInfo]:
    attrs = message.get("IPVS_CMD_ATTR_DEST")
    real = RealServer(attrs.get("IPVS_DEST_ATTR_ADDR"), attrs.get("IPVS_DEST_ATTR_PORT"))
    return real, DestInfo(
        attrs.get("IPVS_DEST_ATTR_WEIGHT"),
        attrs.get("IPVS_DEST_ATTR_ACTIVE_CONNS"),
        attrs.get("IPVS_DEST_ATTR_INACT_CONNS"),
    )


class IpvsKernel:
    def __init__(self, sock: IpvsSocket) -> None:
        self.sock = sock

    def services(self, family: int) -> dict[Frontend, ServiceInfo]:
        """Every address/port virtual server of the family (4 or 6)."""
        found: dict[Frontend, ServiceInfo] = {}
        for message in self.sock.service("dump"):
            parsed = parse_service(message)
            if parsed is not None and family_of(parsed[0].address) == family:
                found[parsed[0]] = parsed[1]
        return found

    def service(self, frontend: Frontend) -> ServiceInfo | None:
        """The virtual server's settings; None when the kernel has none there."""
        try:
            messages = self.sock.service("get", service_key(frontend))
        except NetlinkError as err:
            if err.code in (errno.ESRCH, errno.ENOENT):
                return None
            raise
        for message in messages:
            parsed = parse_service(message)
            if parsed is not None:
                return parsed[1]
        return None

    def dests(self, frontend: Frontend) -> dict[RealServer, DestInfo]:
        """The virtual server's real servers (none when it does not exist)."""
        return dict(
            parse_dest(message) for message in self.sock.dest("dump", service_key(frontend))
        )

    def add_service(self, server: VirtualServer) -> None:
        self.sock.service("add", service_request(server))

    def set_service(self, server: VirtualServer) -> None:
        self.sock.service("set", service_request(server))

    def delete_service(self, frontend: Frontend) -> None:
        self.sock.service("del", service_key(frontend))

    def add_dest(self, frontend: Frontend, real: RealServer, weight: int) -> None:
        self.sock.dest("add", service_key(frontend), dest_request(real, weight))

    def set_dest(self, frontend: Frontend, real: RealServer, weight: int) -> None:
        self.sock.dest("set", service_key(frontend), dest_request(real, weight))

    def delete_dest(self, frontend: Frontend, real: RealServer) -> None:
        self.sock.dest("del", service_key(frontend), dest_request(real, 0))
