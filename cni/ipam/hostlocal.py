"""host-local IPAM served in-process: range sets, round-robin allocation, the shared store."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path

from cni import shapes
from cni.errors import CniError, Code
from cni.ipam.store import Store
from cni.paths import check_directory
from cni.record import Record
from cni.result import DNS, IPAddress, IPConfig, IPNetwork, Result, Route, parse_route

DEFAULT_DATA_DIR = "/var/lib/cni/networks"
IPAM_KEYS = frozenset(
    {
        "type",
        "subnet",
        "rangeStart",
        "rangeEnd",
        "gateway",
        "ranges",
        "routes",
        "dataDir",
        "resolvConf",
    }
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any


class Range(Record):
    __slots__ = ("end", "gateway", "start", "subnet")

    def __init__(
        self, subnet: IPNetwork, start: IPAddress, end: IPAddress, gateway: IPAddress
    ) -> None:
        self.subnet = subnet
        self.start = start
        self.end = end
        self.gateway = gateway

    def contains(self, ip: IPAddress) -> bool:
        return ip.version == self.subnet.version and int(self.start) <= int(ip) <= int(self.end)

    def overlaps(self, other: Range) -> bool:
        return self.subnet.version == other.subnet.version and (
            int(self.start) <= int(other.end) and int(other.start) <= int(self.end)
        )

    def size(self) -> int:
        return int(self.end) - int(self.start) + 1 - int(self.contains(self.gateway))

    def __str__(self) -> str:
        return f"{self.start}-{self.end}"


RangeSet = tuple[Range, ...]


class HostLocalConf(Record):
    __slots__ = ("data_dir", "network", "range_sets", "requested", "resolv_conf", "routes")

    def __init__(
        self,
        network: str,
        range_sets: tuple[RangeSet, ...],
        routes: tuple[Route, ...],
        data_dir: str,
        resolv_conf: str,
        requested: tuple[IPAddress, ...],
    ) -> None:
        self.network = network
        self.range_sets = range_sets
        self.routes = routes
        self.data_dir = data_dir
        self.resolv_conf = resolv_conf
        self.requested = requested


def describe(range_set: RangeSet) -> str:
    return ",".join(str(r) for r in range_set)


def _invalid(msg: str) -> CniError:
    return CniError(Code.INVALID_NETWORK_CONFIG, msg)


def _address(value: Any, what: str) -> IPAddress:
    try:
        return ipaddress.ip_address(str(value).split("/")[0])
    except ValueError as err:
        raise _invalid(f"{what} {value!r} is not an IP address") from err


def _plain_address(value: object, what: str) -> IPAddress:
    """An address written alone, as a range's bounds and gateway are (no prefix length)."""
    if not isinstance(value, str):  # ipaddress takes integers, booleans among them
        raise _invalid(f"{what} {value!r} is not an IP address")
    try:
        return ipaddress.ip_address(value)
    except ValueError as err:
        raise _invalid(f"{what} {value!r} is not an IP address") from err


def parse_range(raw: Any) -> Range:
    if not isinstance(raw, dict) or not isinstance(raw.get("subnet"), str):
        raise _invalid(f"range {raw!r} needs a subnet string")
    try:
        subnet = ipaddress.ip_network(raw["subnet"], strict=True)
    except ValueError as err:
        raise _invalid(f"invalid subnet {raw['subnet']!r}: {err}") from err
    if subnet.prefixlen > subnet.max_prefixlen - 2:
        raise _invalid(f"network {subnet} is too small to allocate from")
    first = subnet.network_address + 1
    last = subnet.broadcast_address - (1 if subnet.version == 4 else 0)
    bounds = {}
    for key, default in (("rangeStart", first), ("rangeEnd", last), ("gateway", first)):
        bounds[key] = _plain_address(raw[key], key) if raw.get(key) else default
        if not int(first) <= int(bounds[key]) <= int(last):
            # the network's own address and IPv4's broadcast are no host's
            raise _invalid(f"{key} {bounds[key]} is not a host address of network {subnet}")
    if int(bounds["rangeStart"]) > int(bounds["rangeEnd"]):
        raise _invalid(f"rangeStart {bounds['rangeStart']} is after rangeEnd {bounds['rangeEnd']}")
    return Range(subnet, bounds["rangeStart"], bounds["rangeEnd"], bounds["gateway"])


def parse_conf(raw: dict[str, Any], network: str, cni_args: dict[str, str]) -> HostLocalConf:
    ipam = raw["ipam"]
    unknown = sorted(set(ipam) - IPAM_KEYS)
    if unknown:
        raise CniError.unsupported_fields("host-local option", ipam, unknown)
    shapes.check(raw, {**shapes.RUNTIME_FIELDS, **shapes.HOST_LOCAL_FIELDS})
    raw_sets: list[Any] = list((raw.get("runtimeConfig") or {}).get("ipRanges") or [])
    if ipam.get("subnet"):
        raw_sets.append(
            [{k: ipam[k] for k in ("subnet", "rangeStart", "rangeEnd", "gateway") if k in ipam}]
        )
    raw_sets.extend(ipam.get("ranges") or [])
    if not raw_sets:
        raise _invalid("host-local needs ranges (or a subnet)")
    range_sets: list[RangeSet] = []
    for index, raw_set in enumerate(raw_sets):
        if not isinstance(raw_set, list) or not raw_set:
            raise _invalid(f"range set {index} must be a non-empty list of ranges")
        range_set = tuple(parse_range(r) for r in raw_set)
        if len({r.subnet.version for r in range_set}) > 1:
            raise _invalid(f"range set {index} mixes address families")
        for i, first in enumerate(range_set):
            for second in range_set[i + 1 :]:
                if first.overlaps(second):
                    raise _invalid(f"range set {index}: ranges {first} and {second} overlap")
        for earlier_index, earlier in enumerate(range_sets):
            if any(a.overlaps(b) for a in earlier for b in range_set):
                raise _invalid(f"range set {earlier_index} overlaps with {index}")
        range_sets.append(range_set)
    try:
        routes = tuple(parse_route(r) for r in ipam.get("routes") or [])
    except (ValueError, TypeError) as err:
        raise _invalid(f"invalid route: {err}") from err
    return HostLocalConf(
        network=network,
        range_sets=tuple(range_sets),
        routes=routes,
        data_dir=check_directory(ipam.get("dataDir") or DEFAULT_DATA_DIR, "ipam.dataDir"),
        resolv_conf=check_directory(ipam.get("resolvConf") or "", "ipam.resolvConf"),
        requested=_requested_ips(raw, cni_args),
    )


def _requested_ips(raw: dict[str, Any], cni_args: dict[str, str]) -> tuple[IPAddress, ...]:
    """CNI_ARGS IP=, args.cni.ips and runtimeConfig.ips, in the reference plugin's order."""
    values: list[Any] = [v for v in cni_args.get("IP", "").split(",") if v]
    values += ((raw.get("args") or {}).get("cni") or {}).get("ips") or []
    values += (raw.get("runtimeConfig") or {}).get("ips") or []
    return tuple(_address(v, "requested IP") for v in values)


def parse_resolv_conf(path: str) -> DNS:
    dns = DNS()
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise CniError(Code.IO_FAILURE, f"cannot read resolvConf {path}: {err}") from err
    for line in lines:
        fields = line.split()
        if not fields or fields[0].startswith(("#", ";")):
            continue
        key, values = fields[0], fields[1:]
        if key == "nameserver":
            dns.nameservers.extend(values)
        elif key == "domain" and values:
            dns.domain = values[0]
        elif key == "search":
            dns.search = values
        elif key == "options":
            dns.options.extend(values)
    return dns


def _candidates(range_set: RangeSet, last: IPAddress | None) -> Iterator[tuple[IPAddress, Range]]:
    """Round-robin from just after the last reserved address, each address once."""
    index = (
        None
        if last is None
        else next((i for i, r in enumerate(range_set) if r.contains(last)), None)
    )
    if index is None or last is None:
        for r in range_set:
            yield from _walk(r, r.start, r.end)
        return
    ordered = range_set[index:] + range_set[:index]
    head = ordered[0]
    if int(last) < int(head.end):
        yield from _walk(head, last + 1, head.end)
    for r in ordered[1:]:
        yield from _walk(r, r.start, r.end)
    yield from _walk(head, head.start, last)


def _walk(r: Range, first: IPAddress, last: IPAddress) -> Iterator[tuple[IPAddress, Range]]:
    ip = first
    while True:
        if ip != r.gateway:
            yield ip, r
        if ip == last:
            return
        ip += 1


class HostLocal:
    def __init__(self, conf: HostLocalConf) -> None:
        self.conf = conf
        self.store = Store(conf.data_dir, conf.network)

    def add(self, container_id: str, ifname: str) -> Result:
        dns = parse_resolv_conf(self.conf.resolv_conf) if self.conf.resolv_conf else DNS()
        requested = list(self.conf.requested)
        ips: list[IPConfig] = []
        with self.store.locked():
            owned = self.store.owned_by(container_id, ifname)
            try:
                for index, range_set in enumerate(self.conf.range_sets):
                    wanted = next((ip for ip in requested if _range_for(range_set, ip)), None)
                    if wanted is not None:
                        requested.remove(wanted)
                    ips.append(
                        self._allocate(index, range_set, container_id, ifname, owned, wanted)
                    )
                if requested:
                    raise CniError(
                        Code.IPAM_FAILURE,
                        f"failed to allocate all requested IPs: {' '.join(map(str, requested))}",
                    )
            except BaseException:
                for ip in ips:
                    self.store.release(ip.address.ip)
                raise
        return Result(ips=ips, routes=list(self.conf.routes), dns=dns)

    def _allocate(
        self,
        index: int,
        range_set: RangeSet,
        container_id: str,
        ifname: str,
        owned: list[IPAddress],
        wanted: IPAddress | None,
    ) -> IPConfig:
        if wanted is not None:
            r = _range_for(range_set, wanted)
            assert r is not None
            if wanted == r.gateway:
                raise CniError(Code.IPAM_FAILURE, f"requested IP {wanted} is the subnet's gateway")
            if not self.store.reserve(wanted, container_id, ifname, index):
                raise CniError(
                    Code.IPAM_FAILURE,
                    f"requested IP {wanted} is not available in range set {describe(range_set)}",
                )
            return _ip_config(wanted, r)
        for ip in owned:
            if _range_for(range_set, ip):
                raise CniError(
                    Code.IPAM_FAILURE,
                    f"{ip} has been allocated to {container_id}, duplicate allocation is not "
                    "allowed",
                )
        for ip, r in _candidates(range_set, self.store.last_reserved(index)):
            if self.store.reserve(ip, container_id, ifname, index):
                return _ip_config(ip, r)
        raise CniError(
            Code.IPAM_FAILURE, f"no IP addresses available in range set: {describe(range_set)}"
        )

    def release(self, container_id: str, ifname: str) -> None:
        with self.store.locked():
            for ip in self.store.released_by(container_id, ifname):
                self.store.release(ip)

    def check(self, container_id: str, ifname: str) -> None:
        with self.store.locked():
            if not self.store.owned_by(container_id, ifname):
                raise CniError(
                    Code.CHECK_FAILED,
                    f"host-local: no address is reserved for {container_id}/{ifname}",
                )

    def gc(self, valid: set[tuple[str, str]]) -> None:
        valid_ids = {cid for cid, _ in valid}
        with self.store.locked():
            for ip, (cid, ifname) in self.store.reservations().items():
                if (cid, ifname) not in valid and not (not ifname and cid in valid_ids):
                    self.store.release(ip)

    def status(self) -> None:
        try:
            self.store.directory.mkdir(parents=True, exist_ok=True)
            probe = self.store.directory / f".status-{os.getpid()}"
            probe.write_text("")
            probe.unlink()
        except OSError as err:
            raise CniError(
                Code.NOT_AVAILABLE, f"IPAM dataDir {self.store.directory} is unusable: {err}"
            ) from err
        with self.store.locked():
            reserved = set(self.store.reservations())
        for range_set in self.conf.range_sets:
            capacity = sum(r.size() for r in range_set)
            used = sum(1 for ip in reserved if _range_for(range_set, ip))
            if used >= capacity:
                raise CniError(
                    Code.NOT_AVAILABLE,
                    f"no IP addresses available in range set: {describe(range_set)}",
                )


def _range_for(range_set: RangeSet, ip: IPAddress) -> Range | None:
    return next((r for r in range_set if r.contains(ip)), None)


def _ip_config(ip: IPAddress, r: Range) -> IPConfig:
    return IPConfig(address=ipaddress.ip_interface(f"{ip}/{r.subnet.prefixlen}"), gateway=r.gateway)
