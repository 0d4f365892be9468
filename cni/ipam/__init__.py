"""IP address management: host-local in-process, anything else delegated."""

from __future__ import annotations

from cni.invocation import Invocation
from cni.result import Result

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Protocol

    class Ipam(Protocol):
        """What an IPAM does for the verbs; the type checker's alone (no call needs it run)."""

        def add(self, container_id: str, ifname: str) -> Result: ...

        def release(self, container_id: str, ifname: str) -> None: ...

        def check(self, container_id: str, ifname: str) -> None: ...

        def gc(self, valid: set[tuple[str, str]]) -> None: ...

        def status(self) -> None: ...


class Layer2Only:
    """No IPAM type (the reference bridge's layer-2 mode): nothing to allocate or give back."""

    def add(self, container_id: str, ifname: str) -> Result:
        return Result()

    def release(self, container_id: str, ifname: str) -> None:
        pass

    def check(self, container_id: str, ifname: str) -> None:
        pass

    def gc(self, valid: set[tuple[str, str]]) -> None:
        pass

    def status(self) -> None:
        pass


def for_config(raw: dict[str, Any], stdin: bytes, invocation: Invocation) -> Ipam:
    plugin_type = raw.get("ipam", {}).get("type")
    if not plugin_type:
        return Layer2Only()
    if plugin_type == "host-local":
        from cni.ipam.hostlocal import HostLocal, parse_conf

        return HostLocal(parse_conf(raw, raw["name"], invocation.args))
    from cni.ipam.delegate import Delegate

    return Delegate(plugin_type, stdin, invocation)
