"""Names and paths that come from a network config: checked once, and one way to join them
onto a directory that cannot leave it."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

from cni.errors import CniError, Code

NETWORK_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
"""The spec's rule for a network's name (libcni's ValidateNetworkName): it names a directory."""
MAX_NAME_BYTES = 255
"""A file name's limit (NAME_MAX)."""


def _invalid(msg: str) -> CniError:
    return CniError(Code.INVALID_NETWORK_CONFIG, msg)


def check_network_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise _invalid("network config needs a non-empty name")
    if NETWORK_NAME.fullmatch(name) is None or len(os.fsencode(name)) > MAX_NAME_BYTES:
        raise _invalid(
            f"name {name!r} is not a network name: a letter or digit, then letters, digits, "
            f"'_', '.' or '-', at most {MAX_NAME_BYTES} bytes"
        )
    return name


def check_plugin_name(value: object, field: str) -> str:
    """A plugin's type: a file name searched in CNI_PATH, as libcni's FindInPath takes it,
    never a path."""
    if not isinstance(value, str):
        raise _invalid(f"{field} must be a string")
    if (
        "/" in value
        or "\0" in value
        or value in (".", "..")
        or len(os.fsencode(value)) > MAX_NAME_BYTES
    ):
        raise _invalid(f"{field} {value!r} is not a plugin name (a file name in CNI_PATH)")
    return value


def check_directory(value: object, field: str) -> str:
    """A directory named by the config: a string without NUL bytes."""
    if not isinstance(value, str) or "\0" in value:
        raise _invalid(f"{field} must be a path string")
    return value


def inside(base: str | Path, name: str) -> Path:
    """base/name, refused (code 7) unless name is one plain component, so the result stays
    directly inside base whatever name holds."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise _invalid(f"{name!r} cannot be a file name inside {base}")
    return Path(base) / name


def narrowed_search_path(requested: str, allowed: Sequence[str]) -> str:
    """The CNI_PATH `requested` less every directory that is not one of `allowed`: in
    requested's order, each spelt as in allowed. A directory matches by its normalized
    spelling, so `..` cannot climb out of one."""
    by_spelling = {os.path.normpath(directory): directory for directory in allowed}
    kept: list[str] = []
    for directory in filter(None, requested.split(":")):
        match = by_spelling.get(os.path.normpath(directory))
        if match is not None and match not in kept:
            kept.append(match)
    return ":".join(kept)
