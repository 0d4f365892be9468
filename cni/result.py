"""The CNI Result, parsed from any supported version and printed in the one asked for."""

from __future__ import annotations

from cni import ip_text
from cni.errors import CniError, Code
from cni.record import Record
from cni.version import at_least

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

IPAddress = ip_text.Address
IPInterface = ip_text.Interface
IPNetwork = ip_text.Network

ROUTE_EXTRAS_1_1 = ("mtu", "advmss", "priority", "table", "scope")
ROUTE_EXTRA_LIMITS = {
    "mtu": 2**32,
    "advmss": 2**32,
    "priority": 2**32,
    "table": 2**32,
    "scope": 256,
}
"""Each extra's kernel field: a u32, and scope a u8."""


class Interface(Record):
    __slots__ = ("mac", "mtu", "name", "sandbox")

    def __init__(self, name: str, mac: str = "", sandbox: str = "", mtu: int = 0) -> None:
        self.name = name
        self.mac = mac
        self.sandbox = sandbox
        self.mtu = mtu


class IPConfig(Record):
    __slots__ = ("address", "gateway", "interface")

    def __init__(
        self, address: IPInterface, gateway: IPAddress | None = None, interface: int | None = None
    ) -> None:
        self.address = address
        self.gateway = gateway
        self.interface = interface


class Route(Record):
    __slots__ = ("dst", "extras", "gw")

    def __init__(
        self, dst: IPNetwork, gw: IPAddress | None = None, extras: dict[str, int] | None = None
    ) -> None:
        self.dst = dst
        self.gw = gw
        self.extras = {} if extras is None else extras


class DNS(Record):
    __slots__ = ("domain", "nameservers", "options", "search")

    def __init__(
        self,
        nameservers: list[str] | None = None,
        domain: str = "",
        search: list[str] | None = None,
        options: list[str] | None = None,
    ) -> None:
        self.nameservers = [] if nameservers is None else nameservers
        self.domain = domain
        self.search = [] if search is None else search
        self.options = [] if options is None else options

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.nameservers:
            out["nameservers"] = self.nameservers
        if self.domain:
            out["domain"] = self.domain
        if self.search:
            out["search"] = self.search
        if self.options:
            out["options"] = self.options
        return out


class Result(Record):
    __slots__ = ("dns", "interfaces", "ips", "routes")

    def __init__(
        self,
        interfaces: list[Interface] | None = None,
        ips: list[IPConfig] | None = None,
        routes: list[Route] | None = None,
        dns: DNS | None = None,
    ) -> None:
        self.interfaces = [] if interfaces is None else interfaces
        self.ips = [] if ips is None else ips
        self.routes = [] if routes is None else routes
        self.dns = DNS() if dns is None else dns

    def to_json(self, cni_version: str) -> dict[str, Any]:
        with_ip_version = not at_least(cni_version, "1.0.0")
        with_1_1_fields = at_least(cni_version, "1.1.0")
        out: dict[str, Any] = {"cniVersion": cni_version}
        if self.interfaces:
            out["interfaces"] = [_interface_json(i, with_1_1_fields) for i in self.interfaces]
        if self.ips:
            out["ips"] = [_ip_json(ip, with_ip_version) for ip in self.ips]
        if self.routes:
            out["routes"] = [_route_json(r, with_1_1_fields) for r in self.routes]
        out["dns"] = self.dns.to_json()
        return out

    @classmethod
    def from_json(cls, data: Any) -> Result:
        """Parse a Result of any version from 0.3.0 on (a prevResult or a delegate's answer)."""
        if not isinstance(data, dict):
            raise CniError(Code.DECODE_FAILURE, "result is not a JSON object")
        try:
            dns = data.get("dns") or {}
            return cls(
                interfaces=[
                    Interface(
                        name=i["name"],
                        mac=i.get("mac", ""),
                        sandbox=i.get("sandbox", ""),
                        mtu=int(i.get("mtu", 0)),
                    )
                    for i in data.get("interfaces") or []
                ],
                ips=[
                    IPConfig(
                        address=ip_text.interface(ip["address"]),
                        gateway=ip_text.address(ip["gateway"]) if ip.get("gateway") else None,
                        interface=ip.get("interface"),
                    )
                    for ip in data.get("ips") or []
                ],
                routes=[parse_route(r) for r in data.get("routes") or []],
                dns=DNS(
                    nameservers=list(dns.get("nameservers") or []),
                    domain=dns.get("domain", ""),
                    search=list(dns.get("search") or []),
                    options=list(dns.get("options") or []),
                ),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as err:
            raise CniError(Code.DECODE_FAILURE, f"cannot decode result: {err}") from err


def parse_route(data: Any) -> Route:
    """A route as CNI writes it: dst (host bits allowed), optional gw and 1.1 extras."""
    if not isinstance(data, dict) or "dst" not in data:
        raise ValueError(f"route {data!r} needs a dst")
    return Route(
        dst=ip_text.network(data["dst"]),
        gw=ip_text.address(data["gw"]) if data.get("gw") else None,
        extras={k: _route_extra(k, data[k]) for k in ROUTE_EXTRAS_1_1 if k in data},
    )


def _route_extra(key: str, value: Any) -> int:
    if type(value) is not int or not 0 <= value < ROUTE_EXTRA_LIMITS[key]:
        raise ValueError(f"route {key} {value!r} is not an integer 0-{ROUTE_EXTRA_LIMITS[key] - 1}")
    return value


def _interface_json(iface: Interface, with_mtu: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"name": iface.name}
    if iface.mac:
        out["mac"] = iface.mac
    if with_mtu and iface.mtu:
        out["mtu"] = iface.mtu
    if iface.sandbox:
        out["sandbox"] = iface.sandbox
    return out


def _ip_json(ip: IPConfig, with_version: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if with_version:
        out["version"] = str(ip.address.version)
    out["address"] = str(ip.address)
    if ip.gateway is not None:
        out["gateway"] = str(ip.gateway)
    if ip.interface is not None:
        out["interface"] = ip.interface
    return out


def _route_json(route: Route, with_extras: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"dst": str(route.dst)}
    if route.gw is not None:
        out["gw"] = str(route.gw)
    if with_extras:
        out.update(route.extras)
    return out
