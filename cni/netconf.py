"""The bridge network configuration: every option checked, unknown ones named."""

from __future__ import annotations

from cni import shapes
from cni.errors import CniError, Code
from cni.invocation import valid_ifname
from cni.paths import check_network_name, check_plugin_name
from cni.record import Record
from cni.result import DNS
from cni.version import require_supported

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Keys the runtime (libcni) inserts or that the spec defines for every plugin.
RUNTIME_KEYS = frozenset(
    {
        "cniVersion",
        "cniVersions",
        "name",
        "type",
        "ipam",
        "dns",
        "args",
        "capabilities",
        "runtimeConfig",
        "prevResult",
        "cni.dev/valid-attachments",
        "cni.dev/attachments",
    }
)
BRIDGE_OPTIONS = {
    "bridge": str,
    "isGateway": bool,
    "isDefaultGateway": bool,
    "forceAddress": bool,
    "ipMasq": bool,
    "ipMasqBackend": str,
    "mtu": int,
    "hairpinMode": bool,
    "promiscMode": bool,
    "vlan": int,
    "macspoofchk": bool,
    "enabledad": bool,
}
MASQ_BACKENDS = ("iptables", "nftables")
DEFAULT_BRIDGE = "cni0"
MAX_VLAN = 4094
MIN_MTU, IPV6_MIN_MTU, MAX_MTU = 68, 1280, 65535
"""IPv4's minimum link MTU, IPv6's (below it the kernel turns IPv6 off on the link), and the
largest an Ethernet link takes."""
DNS_LISTS = ("nameservers", "search", "options")


class NetConf(Record):
    __slots__ = (
        "bridge",
        "cni_version",
        "dns",
        "enable_dad",
        "force_address",
        "hairpin_mode",
        "ip_masq",
        "ip_masq_backend",
        "ipam",
        "is_default_gateway",
        "is_gateway",
        "mac_spoof_check",
        "mtu",
        "name",
        "promisc_mode",
        "vlan",
    )

    def __init__(
        self,
        cni_version: str,
        name: str,
        ipam: dict[str, Any],
        bridge: str = DEFAULT_BRIDGE,
        is_gateway: bool = False,
        is_default_gateway: bool = False,
        force_address: bool = False,
        ip_masq: bool = False,
        ip_masq_backend: str = "iptables",
        mtu: int = 0,
        hairpin_mode: bool = False,
        promisc_mode: bool = False,
        vlan: int = 0,
        mac_spoof_check: bool = False,
        enable_dad: bool = False,
        dns: DNS | None = None,
    ) -> None:
        self.cni_version = cni_version
        self.name = name
        self.ipam = ipam
        self.bridge = bridge
        self.is_gateway = is_gateway
        self.is_default_gateway = is_default_gateway
        self.force_address = force_address
        self.ip_masq = ip_masq
        self.ip_masq_backend = ip_masq_backend
        self.mtu = mtu
        self.hairpin_mode = hairpin_mode
        self.promisc_mode = promisc_mode
        self.vlan = vlan
        self.mac_spoof_check = mac_spoof_check
        self.enable_dad = enable_dad
        # The config's own dns: in the result in place of IPAM's when set (the reference's
        # rule).
        self.dns = dns


def parse_version_and_name(raw: dict[str, Any]) -> tuple[str, str]:
    """The two keys every verb needs, even those that take no bridge options."""
    version = raw.get("cniVersion")
    if not isinstance(version, str):
        raise CniError(Code.INVALID_NETWORK_CONFIG, "network config needs a string cniVersion")
    require_supported(version)
    return version, check_network_name(raw.get("name"))


def parse(raw: dict[str, Any]) -> NetConf:
    version, name = parse_version_and_name(raw)
    unknown = sorted(set(raw) - RUNTIME_KEYS - set(BRIDGE_OPTIONS))
    if unknown:
        raise CniError.unsupported_fields(
            "option", raw, unknown, f"known options: {', '.join(sorted(BRIDGE_OPTIONS))}"
        )
    for key, kind in BRIDGE_OPTIONS.items():
        if key in raw and type(raw[key]) is not kind:
            raise CniError(Code.INVALID_NETWORK_CONFIG, f"option {key} must be a {kind.__name__}")
    shapes.check(raw, shapes.RUNTIME_FIELDS)
    ipam = raw.get("ipam", {})
    if not isinstance(ipam, dict):  # a null ipam too: the field is optional, null is no object
        raise CniError(Code.INVALID_NETWORK_CONFIG, "ipam must be an object")
    if ipam.get("type"):
        check_plugin_name(ipam["type"], "ipam.type")
    elif ipam.get("type", "") != "":
        raise CniError(Code.INVALID_NETWORK_CONFIG, "ipam.type must be a string")
    # Without IPAM there is no address to route, gateway or masquerade: the reference bridge
    # ignores those three options then, and so do we.
    layer3 = bool(ipam.get("type"))
    conf = NetConf(
        cni_version=version,
        name=name,
        ipam=ipam,
        bridge=raw.get("bridge", DEFAULT_BRIDGE),
        is_gateway=layer3 and (raw.get("isGateway", False) or raw.get("isDefaultGateway", False)),
        is_default_gateway=layer3 and raw.get("isDefaultGateway", False),
        force_address=raw.get("forceAddress", False),
        ip_masq=layer3 and raw.get("ipMasq", False),
        ip_masq_backend=raw.get("ipMasqBackend", "iptables"),
        mtu=raw.get("mtu", 0),
        hairpin_mode=raw.get("hairpinMode", False),
        promisc_mode=raw.get("promiscMode", False),
        vlan=raw.get("vlan", 0),
        mac_spoof_check=raw.get("macspoofchk", False),
        enable_dad=raw.get("enabledad", False),
        dns=parse_dns(raw.get("dns")),
    )
    _check_consistency(conf)
    return conf


def parse_dns(raw: Any) -> DNS | None:
    """The config's dns, or None when it sets nothing: no list (even an empty one) and no
    domain, as the reference bridge decides."""
    if raw is None:
        return None
    _check_dns(raw)
    if all(raw.get(key) is None for key in DNS_LISTS) and not raw.get("domain"):
        return None
    return DNS(
        nameservers=list(raw.get("nameservers") or []),
        domain=raw.get("domain") or "",
        search=list(raw.get("search") or []),
        options=list(raw.get("options") or []),
    )


def _check_dns(raw: Any) -> None:
    if not isinstance(raw, dict):
        raise CniError(Code.INVALID_NETWORK_CONFIG, "dns must be an object")
    for key in DNS_LISTS:
        value = raw.get(key)
        if value is not None and not (
            isinstance(value, list) and all(isinstance(v, str) for v in value)
        ):
            raise CniError(Code.INVALID_NETWORK_CONFIG, f"dns.{key} must be a list of strings")
    if not isinstance(raw.get("domain") or "", str):
        raise CniError(Code.INVALID_NETWORK_CONFIG, "dns.domain must be a string")


def _has_ipv6_ranges(ipam: dict[str, Any]) -> bool:
    """Whether host-local's subnet or ranges name an IPv6 network (shapes were checked)."""
    subnets = [ipam.get("subnet")]
    subnets += [r.get("subnet") for range_set in ipam.get("ranges") or [] for r in range_set]
    return any(isinstance(s, str) and ":" in s for s in subnets)


def _check_consistency(conf: NetConf) -> None:
    problems = []
    if not valid_ifname(conf.bridge):
        problems.append(f"bridge name {conf.bridge!r} is not a valid interface name")
    if conf.hairpin_mode and conf.promisc_mode:
        problems.append("hairpinMode and promiscMode cannot both be set")
    if conf.ip_masq_backend not in MASQ_BACKENDS:
        problems.append(f"ipMasqBackend must be one of {MASQ_BACKENDS}")
    if not 0 <= conf.vlan <= MAX_VLAN:
        problems.append(f"vlan {conf.vlan} is outside 0-{MAX_VLAN}")
    if conf.vlan and conf.is_gateway:
        problems.append(
            f"vlan {conf.vlan} cannot be used with isGateway or isDefaultGateway: the gateway "
            "address would be on the bridge's VLAN 1 only, out of the pods' reach"
        )
    if conf.mtu < 0 or 0 < conf.mtu < MIN_MTU:
        problems.append(f"mtu {conf.mtu} is too small")
    elif conf.mtu > MAX_MTU:
        problems.append(f"mtu {conf.mtu} is above {MAX_MTU}")
    elif 0 < conf.mtu < IPV6_MIN_MTU and _has_ipv6_ranges(conf.ipam):
        problems.append(f"mtu {conf.mtu} is below IPv6's minimum {IPV6_MIN_MTU}, and ipam has IPv6")
    if problems:
        raise CniError(Code.INVALID_NETWORK_CONFIG, "; ".join(problems))
