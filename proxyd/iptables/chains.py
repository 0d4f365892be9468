"""Names of the chains the proxy owns (a KNIT- prefix, beside kube-proxy's KUBE- ones)."""

from __future__ import annotations

from proxyd.model import Endpoint, ServicePortName
from proxyd.naming import short_hash

SERVICES = "KNIT-SERVICES"
EXTERNAL_SERVICES = "KNIT-EXTERNAL-SERVICES"
NODEPORTS = "KNIT-NODEPORTS"
POSTROUTING = "KNIT-POSTROUTING"
MARK_MASQ = "KNIT-MARK-MASQ"
FORWARD = "KNIT-FORWARD"
PROXY_FIREWALL = "KNIT-PROXY-FIREWALL"
LOCALNET_FIREWALL = "KNIT-FIREWALL"

BASE_CHAINS = frozenset(
    {
        SERVICES,
        EXTERNAL_SERVICES,
        NODEPORTS,
        POSTROUTING,
        MARK_MASQ,
        FORWARD,
        PROXY_FIREWALL,
        LOCALNET_FIREWALL,
    }
)
SERVICE_CHAIN_PREFIXES = ("KNIT-SVC-", "KNIT-SVL-", "KNIT-EXT-", "KNIT-FW-", "KNIT-SEP-")

KUBE_PROXY_BASE_CHAINS = frozenset(
    {
        "KUBE-SERVICES",
        "KUBE-EXTERNAL-SERVICES",
        "KUBE-NODEPORTS",
        "KUBE-POSTROUTING",
        "KUBE-MARK-MASQ",
        "KUBE-MARK-DROP",
        "KUBE-FORWARD",
        "KUBE-PROXY-FIREWALL",
        "KUBE-PROXY-CANARY",
        "KUBE-LOAD-BALANCER",
    }
)
KUBE_PROXY_CHAIN_PREFIXES = (
    "KUBE-SVC-",
    "KUBE-SVL-",
    "KUBE-EXT-",
    "KUBE-FW-",
    "KUBE-SEP-",
    "KUBE-XLB-",
)


def owned_by_knit(chain: str) -> bool:
    return chain in BASE_CHAINS or chain.startswith(SERVICE_CHAIN_PREFIXES)


def owned_by_kube_proxy(chain: str) -> bool:
    return chain in KUBE_PROXY_BASE_CHAINS or chain.startswith(KUBE_PROXY_CHAIN_PREFIXES)


class ServiceChains:
    """The per-service chain names of one service port."""

    def __init__(self, name: ServicePortName) -> None:
        self.name = name
        suffix = short_hash(f"{name}{name.protocol.lower()}")
        self.cluster = f"KNIT-SVC-{suffix}"
        self.local = f"KNIT-SVL-{suffix}"
        self.external = f"KNIT-EXT-{suffix}"
        self.firewall = f"KNIT-FW-{suffix}"

    def endpoint(self, endpoint: Endpoint) -> str:
        return f"KNIT-SEP-{short_hash(f'{self.name}{self.name.protocol.lower()}{endpoint}')}"
