"""Spec versions this plugin speaks and how they compare."""

from __future__ import annotations

from cni.errors import CniError, Code

SUPPORTED_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
LATEST = SUPPORTED_VERSIONS[-1]


def parse(version: str) -> tuple[int, int, int]:
    try:
        major, minor, patch = (int(part) for part in version.split("."))
    except ValueError as err:
        raise CniError(Code.DECODE_FAILURE, f"cannot parse cniVersion {version!r}") from err
    return major, minor, patch


def require_supported(version: str) -> None:
    if version not in SUPPORTED_VERSIONS:
        raise CniError(
            Code.INCOMPATIBLE_VERSION,
            f"incompatible CNI versions: config is {version!r}, "
            f"plugin supports {list(SUPPORTED_VERSIONS)}",
        )


def at_least(version: str, minimum: str) -> bool:
    return parse(version) >= parse(minimum)
