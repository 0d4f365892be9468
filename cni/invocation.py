"""The runtime's side of a call: environment variables and stdin, validated."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from contextvars import ContextVar

from cni.errors import CniError, Code
from cni.record import Record

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

COMMANDS = ("ADD", "DEL", "CHECK", "STATUS", "VERSION", "GC")
ATTACHMENT_COMMANDS = ("ADD", "DEL", "CHECK")
CONTAINER_ID_PATTERN = re.compile(r"[a-zA-Z0-9][a-zA-Z0-9_.\-]*")
KNOWN_ARGS = frozenset(
    {
        "IgnoreUnknown",
        "K8S_POD_NAMESPACE",
        "K8S_POD_NAME",
        "K8S_POD_INFRA_CONTAINER_ID",
        "K8S_POD_UID",
        "IP",
        "MAC",
    }
)
# IFNAMSIZ less the terminating NUL: the kernel counts bytes, not characters.
MAX_IFNAME_BYTES = 15
IFNAME_FORBIDDEN = "/:\"';\\"
CNI_PREFIX = "CNI_"
# The variables the spec defines for a plugin: all a delegated plugin is given of the call's.
SPEC_VARIABLES = (
    "CNI_COMMAND",
    "CNI_CONTAINERID",
    "CNI_NETNS",
    "CNI_IFNAME",
    "CNI_ARGS",
    "CNI_PATH",
)

# When (time.monotonic()) the call being served must have ended, if its caller set a time: the
# node daemon does for each call it serves (cni.server), in the call's thread; a call run
# in-process is bounded by the runtime that started it.
call_deadline: ContextVar[float | None] = ContextVar("call_deadline", default=None)
# Called by an ADD with the addresses its IPAM gave the sandbox, before the sandbox's interface
# is attached, so before its first packet: the node daemon writes the pod's NetworkPolicy
# isolation there (cni.server); a call run in-process has none.
attaching: ContextVar[Callable[[tuple[str, ...]], None] | None] = ContextVar(
    "attaching", default=None
)


class Invocation(Record):
    __slots__ = (
        "args",
        "cni_path",
        "command",
        "container_id",
        "ifname",
        "netns",
        "netns_fd",
        "variables",
    )

    def __init__(
        self,
        command: str,
        container_id: str,
        netns: str,
        ifname: str,
        args: dict[str, str],
        cni_path: tuple[str, ...],
        variables: dict[str, str] | None = None,
        netns_fd: int | None = None,
    ) -> None:
        self.command = command
        self.container_id = container_id
        self.netns = netns
        self.ifname = ifname
        self.args = args
        self.cni_path = cni_path
        # The call's own CNI_* variables, for a delegated plugin: a call served by the node
        # daemon must not see the daemon's environment.
        self.variables = {} if variables is None else variables
        # CNI_NETNS opened by the caller (the fast path's plugin): the verbs use it in place
        # of opening the path, which the node daemon may not resolve.
        self.netns_fd = netns_fd


def from_environ(environ: Mapping[str, str], netns_fd: int | None = None) -> Invocation:
    command = environ.get("CNI_COMMAND", "")
    if not command:
        raise CniError(Code.INVALID_ENV, "required env variable CNI_COMMAND is missing")
    if command not in COMMANDS:
        raise CniError(Code.INVALID_ENV, f"CNI_COMMAND {command!r} is not one of {COMMANDS}")
    container_id = environ.get("CNI_CONTAINERID", "")
    netns = environ.get("CNI_NETNS", "")
    ifname = environ.get("CNI_IFNAME", "")
    if command in ATTACHMENT_COMMANDS:
        required = {"CNI_CONTAINERID": container_id, "CNI_IFNAME": ifname}
        if command != "DEL":
            required["CNI_NETNS"] = netns
        missing = [name for name, value in required.items() if not value]
        if missing:
            raise CniError(
                Code.INVALID_ENV, f"required env variables {', '.join(missing)} are missing"
            )
        validate_container_id(container_id)
        validate_ifname(ifname)
    return Invocation(
        command=command,
        container_id=container_id,
        netns=netns,
        ifname=ifname,
        args=attachment_args(command, environ.get("CNI_ARGS", "")),
        cni_path=tuple(p for p in environ.get("CNI_PATH", "").split(":") if p),
        variables={k: v for k, v in environ.items() if k.startswith(CNI_PREFIX)},
        netns_fd=netns_fd,
    )


def validate_container_id(container_id: str) -> None:
    if not CONTAINER_ID_PATTERN.fullmatch(container_id):
        raise CniError(
            Code.INVALID_ENV,
            f"CNI_CONTAINERID {container_id!r} must match {CONTAINER_ID_PATTERN.pattern}",
        )


def valid_ifname(name: str) -> bool:
    """The kernel's rule for a link's name (dev_valid_name: no '/', ':' or whitespace), less
    quotes, backslashes, ';' and control characters: the name is written into the quoted
    comment of the attachment's iptables and nftables rules (cni.kernel.firewall.Tag), where a quote
    would end the comment and the rest be read as rule text."""
    return (
        0 < len(os.fsencode(name)) <= MAX_IFNAME_BYTES
        and name not in (".", "..")
        and not any(c in IFNAME_FORBIDDEN or c.isspace() or not c.isprintable() for c in name)
    )


def validate_ifname(ifname: str) -> None:
    if len(os.fsencode(ifname)) > MAX_IFNAME_BYTES:
        raise CniError(
            Code.INVALID_ENV, f"CNI_IFNAME {ifname!r} is longer than {MAX_IFNAME_BYTES} bytes"
        )
    if not valid_ifname(ifname):
        raise CniError(
            Code.INVALID_ENV,
            f"CNI_IFNAME {ifname!r} is not an interface name: no {IFNAME_FORBIDDEN}, "
            "whitespace or control characters, and not '.' or '..'",
        )


def attachment_args(command: str, raw: str) -> dict[str, str]:
    """CNI_ARGS, which only the verbs on an attachment take: the others ignore it."""
    return parse_cni_args(raw) if command in ATTACHMENT_COMMANDS else {}


def parse_cni_args(raw: str) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for item in filter(None, raw.split(";")):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CniError(Code.INVALID_ENV, f"CNI_ARGS: {item!r} is not KEY=VALUE")
        pairs[key] = value
    ignore_unknown = pairs.get("IgnoreUnknown", "").lower() in ("1", "true")
    unknown = sorted(set(pairs) - KNOWN_ARGS)
    if unknown and not ignore_unknown:
        raise CniError(Code.INVALID_ENV, f"CNI_ARGS: unknown keys {unknown} (no IgnoreUnknown)")
    return pairs


def parse_stdin(raw: bytes) -> dict[str, Any]:
    try:
        conf = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        raise CniError(Code.DECODE_FAILURE, f"cannot decode network config: {err}") from err
    except RecursionError as err:  # the decoder recurses once per level of nesting
        raise CniError(Code.DECODE_FAILURE, "network config is nested too deeply") from err
    if not isinstance(conf, dict):
        raise CniError(Code.DECODE_FAILURE, "network config is not a JSON object")
    return conf
