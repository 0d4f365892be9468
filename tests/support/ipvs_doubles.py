"""A fake IPVS table modelled on the kernel's, and the generic-netlink wire it is spoken over."""

from __future__ import annotations

import errno
import socket
from typing import Any

from pyroute2.netlink.exceptions import NetlinkError
from pyroute2.netlink.generic import ipvs as genl

COMMANDS = {
    ("service", "add"): genl.IPVS_CMD_NEW_SERVICE,
    ("service", "set"): genl.IPVS_CMD_SET_SERVICE,
    ("service", "del"): genl.IPVS_CMD_DEL_SERVICE,
    ("service", "get"): genl.IPVS_CMD_GET_SERVICE,
    ("service", "dump"): genl.IPVS_CMD_GET_SERVICE,
    ("dest", "add"): genl.IPVS_CMD_NEW_DEST,
    ("dest", "set"): genl.IPVS_CMD_SET_DEST,
    ("dest", "del"): genl.IPVS_CMD_DEL_DEST,
    ("dest", "dump"): genl.IPVS_CMD_GET_DEST,
}


def wire(cmd: int, attrs: list[tuple[str, Any]]) -> genl.ipvsmsg:
    """The message as bytes on the socket, decoded again."""
    msg = genl.ipvsmsg()
    msg["cmd"] = cmd
    msg["version"] = genl.GENL_VERSION
    msg["attrs"] = attrs
    msg.encode()
    decoded = genl.ipvsmsg(msg.data)
    decoded.decode()
    return decoded


def attrs_of(nla: Any) -> dict[str, Any]:
    return {name: value for name, value in nla["attrs"]}


def nested(values: dict[str, Any]) -> dict[str, Any]:
    return {"attrs": list(values.items())}


def key_of(svc: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(svc[f"IPVS_SVC_ATTR_{k}"] for k in ("AF", "ADDR", "PROTOCOL", "PORT"))


class FakeIpvs:
    """IPVS tables modelled on the kernel's, behind pyroute2.IPVS's two methods."""

    def __init__(self) -> None:
        self.services: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.dests: dict[tuple[Any, ...], dict[tuple[str, int], dict[str, Any]]] = {}
        self.connections: dict[tuple[str, int], tuple[int, int]] = {}
        self.log: list[tuple[str, str, genl.ipvsmsg]] = []

    def writes(self) -> list[tuple[str, str]]:
        return [(what, cmd) for what, cmd, _ in self.log if cmd not in ("get", "dump")]

    def dumped_dests(self) -> bool:
        return ("dest", "dump") in [(what, cmd) for what, cmd, _ in self.log]

    def service(self, command: str, service: Any = None) -> Any:
        attrs = [] if service is None else [("IPVS_CMD_ATTR_SERVICE", service.dump_nla())]
        msg = wire(COMMANDS[("service", command)], attrs)
        self.log.append(("service", command, msg))
        if command == "dump":
            return [self._reply(svc) for svc in self.services.values()]
        svc = attrs_of(msg.get("IPVS_CMD_ATTR_SERVICE"))
        key = key_of(svc)
        if command == "add":
            self.services[key] = svc
            self.dests[key] = {}
        elif command == "set":
            self.services[key].update(svc)
        elif command == "del":
            del self.services[key], self.dests[key]
        elif key not in self.services:
            raise NetlinkError(errno.ESRCH)
        else:
            return [self._reply(self.services[key])]
        return []

    def _reply(self, svc: dict[str, Any]) -> genl.ipvsmsg:
        return wire(
            genl.IPVS_CMD_NEW_SERVICE, [("IPVS_CMD_ATTR_SERVICE", {"attrs": list(svc.items())})]
        )

    def dest(self, command: str, service: Any, dest: Any = None) -> Any:
        attrs = [("IPVS_CMD_ATTR_SERVICE", service.dump_key())]
        if dest is not None:
            attrs.append(("IPVS_CMD_ATTR_DEST", dest.dump_nla()))
        msg = wire(COMMANDS[("dest", command)], attrs)
        self.log.append(("dest", command, msg))
        dests = self.dests.get(key_of(attrs_of(msg.get("IPVS_CMD_ATTR_SERVICE"))), {})
        if command == "dump":
            replies = []
            for (ip, port), values in dests.items():
                active, inactive = self.connections.get((ip, port), (0, 0))
                values = {
                    **values,
                    "IPVS_DEST_ATTR_ACTIVE_CONNS": active,
                    "IPVS_DEST_ATTR_INACT_CONNS": inactive,
                }
                replies.append(
                    wire(
                        genl.IPVS_CMD_NEW_DEST,
                        [("IPVS_CMD_ATTR_DEST", {"attrs": list(values.items())})],
                    )
                )
            return replies
        real = attrs_of(msg.get("IPVS_CMD_ATTR_DEST"))
        rkey = (real["IPVS_DEST_ATTR_ADDR"], real["IPVS_DEST_ATTR_PORT"])
        if command == "del":
            del dests[rkey]
        else:
            dests.setdefault(rkey, {}).update(real)
        return []

    def weights(self, address: str, port: int, protocol: int = 6) -> dict[tuple[str, int], int]:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        dests = self.dests[(family, address, protocol, port)]
        return {rkey: d["IPVS_DEST_ATTR_WEIGHT"] for rkey, d in dests.items()}

    def close(self) -> None:
        pass
