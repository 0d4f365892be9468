"""The JSON shapes the fields of a network config must have, checked before any is read, so
that a field of the wrong type is an invalid config (code 7) naming the field, not a crash."""

from __future__ import annotations

from collections.abc import Mapping

from cni.errors import CniError, Code

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

OBJECT, STRING, STRINGS, OBJECTS, OBJECT_LISTS = (
    "an object",
    "a string",
    "a list of strings",
    "a list of objects",
    "a list of lists of objects",
)

"""What a field must hold, as the error message says it."""

RUNTIME_FIELDS: dict[str, str] = {
    "args": OBJECT,
    "args.cni": OBJECT,
    "args.cni.ips": STRINGS,
    "args.cni.mac": STRING,
    "runtimeConfig": OBJECT,
    "runtimeConfig.ips": STRINGS,
    "runtimeConfig.mac": STRING,
    "runtimeConfig.ipRanges": OBJECT_LISTS,
    "capabilities": OBJECT,
    "prevResult": OBJECT,
}
"""The fields every verb may read, whatever the IPAM type."""

HOST_LOCAL_FIELDS: dict[str, str] = {
    "ipam.subnet": STRING,
    "ipam.rangeStart": STRING,
    "ipam.rangeEnd": STRING,
    "ipam.gateway": STRING,
    "ipam.ranges": OBJECT_LISTS,
    "ipam.routes": OBJECTS,
}


def _holds(value: Any, shape: str) -> bool:
    if shape == OBJECT:
        return isinstance(value, dict)
    if shape == STRING:
        return isinstance(value, str)
    if shape == STRINGS:
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    if shape == OBJECTS:
        return isinstance(value, list) and all(isinstance(v, dict) for v in value)
    return isinstance(value, list) and all(_holds(v, OBJECTS) for v in value)


def check(raw: Mapping[str, Any], fields: Mapping[str, str]) -> None:
    """Each dotted field present in raw (null counts as absent, as the readers take it) holds
    its shape; a field's parents are checked before it, so each lookup below is safe."""
    for dotted, shape in fields.items():
        value: Any = raw
        for key in dotted.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None and not _holds(value, shape):
            raise CniError(Code.INVALID_NETWORK_CONFIG, f"{dotted} must be {shape}")
