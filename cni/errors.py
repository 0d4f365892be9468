"""CNI error codes and the exception that carries them to the error JSON."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from enum import IntEnum


class Code(IntEnum):
    INCOMPATIBLE_VERSION = 1
    UNSUPPORTED_FIELD = 2
    UNKNOWN_CONTAINER = 3
    INVALID_ENV = 4
    IO_FAILURE = 5
    DECODE_FAILURE = 6
    INVALID_NETWORK_CONFIG = 7
    TRY_AGAIN_LATER = 11
    NOT_AVAILABLE = 50
    NOT_AVAILABLE_EXISTING_AFFECTED = 51
    # The plugin's own codes (100 and above).
    INTERFACE_EXISTS = 100
    NETLINK_FAILURE = 101
    IPAM_FAILURE = 102
    FIREWALL_FAILURE = 103
    DELEGATE_FAILURE = 104
    CHECK_FAILED = 105
    UNEXPECTED = 199


class CniError(Exception):
    """An error that the plugin reports as the spec's error JSON."""

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code = int(code)
        self.msg = msg
        self.details = details

    @classmethod
    def unsupported_fields(
        cls, what: str, raw: Mapping[str, object], keys: Iterable[str], details: str = ""
    ) -> CniError:
        """Code 2, naming each field with its value as the spec asks."""
        fields = ", ".join(f"{key}={json.dumps(raw[key])}" for key in keys)
        return cls(Code.UNSUPPORTED_FIELD, f"unknown {what}(s) {fields}", details)

    def to_json(self, cni_version: str) -> dict[str, object]:
        out: dict[str, object] = {"cniVersion": cni_version, "code": self.code, "msg": self.msg}
        if self.details:
            out["details"] = self.details
        return out
