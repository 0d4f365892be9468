"""Names of what the IPVS datapath owns: its dummy link, ipsets and iptables chains.

ipsets follow kube-proxy's IPVS-mode sets with a KNIT- prefix for IPv4 and KNIT6- for IPv6
(one name space per network namespace holds both families, and a -6 suffix would make
KNIT-LOAD-BALANCER-SOURCE-CIDR-6 longer than ipset's 31 characters). Chains are KNIT-IPVS-*,
which the iptables mode's chains (KNIT-SERVICES, KNIT-SVC-* ...) never match, and the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxyd.model import PROTOCOLS as PROTOCOLS

DUMMY = "knit-ipvs0"

CHAIN_PREFIX = "KNIT-IPVS-"
SERVICES = "KNIT-IPVS-SERVICES"
NODE_PORT = "KNIT-IPVS-NODE-PORT"
LOAD_BALANCER = "KNIT-IPVS-LOAD-BALANCER"
MARK_MASQ = "KNIT-IPVS-MARK-MASQ"
POSTROUTING = "KNIT-IPVS-POSTROUTING"
FIREWALL = "KNIT-IPVS-FIREWALL"
SOURCE_RANGES = "KNIT-IPVS-SOURCE-RANGES"
NO_ENDPOINTS = "KNIT-IPVS-NO-ENDPOINTS"
FILTER = "KNIT-IPVS-FILTER"
HEALTH_CHECK = "KNIT-IPVS-HEALTH-CHECK"
FORWARD = "KNIT-IPVS-FORWARD"


@dataclass(frozen=True)
class SetSpec:
    key: str
    """The name without its family prefix."""
    type: str


CLUSTER_IP = SetSpec("CLUSTER-IP", "hash:ip,port")
LOOP_BACK = SetSpec("LOOP-BACK", "hash:ip,port,ip")
EXTERNAL_IP = SetSpec("EXTERNAL-IP", "hash:ip,port")
EXTERNAL_IP_LOCAL = SetSpec("EXTERNAL-IP-LOCAL", "hash:ip,port")
LOAD_BALANCER_SET = SetSpec("LOAD-BALANCER", "hash:ip,port")
LOAD_BALANCER_LOCAL = SetSpec("LOAD-BALANCER-LOCAL", "hash:ip,port")
LOAD_BALANCER_FW = SetSpec("LOAD-BALANCER-FW", "hash:ip,port")
SOURCE_CIDR = SetSpec("LOAD-BALANCER-SOURCE-CIDR", "hash:ip,port,net")
NODE_PORTS = {p: SetSpec(f"NODE-PORT-{p}", "bitmap:port") for p in PROTOCOLS}
NODE_PORTS_LOCAL = {p: SetSpec(f"NODE-PORT-LOCAL-{p}", "bitmap:port") for p in PROTOCOLS}
HEALTH_CHECK_NODE_PORT = SetSpec("HEALTH-CHECK-NODE-PORT", "bitmap:port")
IPVS_IPS = SetSpec("IPVS-IPS", "hash:ip")
NO_ENDPOINTS_SET = SetSpec("NO-ENDPOINTS", "hash:ip,port")
NO_LOCAL_ENDPOINTS = SetSpec("NO-LOCAL-ENDPOINTS", "hash:ip,port")

SETS: tuple[SetSpec, ...] = (
    CLUSTER_IP,
    LOOP_BACK,
    EXTERNAL_IP,
    EXTERNAL_IP_LOCAL,
    LOAD_BALANCER_SET,
    LOAD_BALANCER_LOCAL,
    LOAD_BALANCER_FW,
    SOURCE_CIDR,
    *NODE_PORTS.values(),
    *NODE_PORTS_LOCAL.values(),
    HEALTH_CHECK_NODE_PORT,
    IPVS_IPS,
    NO_ENDPOINTS_SET,
    NO_LOCAL_ENDPOINTS,
)
SETS_BY_KEY = {spec.key: spec for spec in SETS}


def set_name(key: str, family: int) -> str:
    return f"KNIT-{key}" if family == 4 else f"KNIT6-{key}"


def swap_name(family: int) -> str:
    """The scratch set a full sync fills and swaps in."""
    return set_name("SWAP", family)


def owned_set(name: str) -> bool:
    return name.startswith(("KNIT-", "KNIT6-"))


def owned_chain(chain: str) -> bool:
    return chain.startswith(CHAIN_PREFIX)
