"""Any IPAM type other than host-local: exec that plugin from CNI_PATH, as the spec says."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

from cni.errors import CniError, Code
from cni.invocation import CNI_PREFIX, Invocation
from cni.paths import inside
from cni.result import Result


def _decode(answer: bytes) -> Result:
    try:
        data = json.loads(answer)
    except ValueError as err:
        raise CniError(Code.DECODE_FAILURE, f"IPAM plugin answer: {err}") from err
    return Result.from_json(data)


class Delegate:
    def __init__(self, plugin_type: str, stdin: bytes, invocation: Invocation) -> None:
        self.plugin_type = plugin_type
        self.stdin = stdin
        self.invocation = invocation

    def _executable(self) -> Path:
        for directory in self.invocation.cni_path:
            candidate = inside(directory, self.plugin_type)
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
        raise CniError(
            Code.DELEGATE_FAILURE,
            f"IPAM plugin {self.plugin_type!r} not found in CNI_PATH "
            f"{':'.join(self.invocation.cni_path)!r}",
        )

    def _call(self, command: str) -> bytes:
        env = {k: v for k, v in os.environ.items() if not k.startswith(CNI_PREFIX)}
        env.update(self.invocation.variables, CNI_COMMAND=command)
        netns_fd = self.invocation.netns_fd
        if netns_fd is not None:
            # The fast path's daemon may not resolve the runtime's CNI_NETNS, and so neither
            # may its child: the child gets the namespace the plugin opened, by descriptor.
            env["CNI_NETNS"] = f"/proc/self/fd/{netns_fd}"
        proc = subprocess.run(
            [self._executable()],
            input=self.stdin,
            env=env,
            capture_output=True,
            check=False,
            pass_fds=() if netns_fd is None else (netns_fd,),
        )
        if proc.returncode == 0:
            return proc.stdout
        try:
            answer = json.loads(proc.stdout)
            raise CniError(int(answer["code"]), answer.get("msg", ""), answer.get("details", ""))
        except (ValueError, KeyError, TypeError):
            raise CniError(
                Code.DELEGATE_FAILURE,
                f"IPAM plugin {self.plugin_type} {command} failed",
                (proc.stderr or proc.stdout).decode(errors="replace"),
            ) from None

    def add(self, container_id: str, ifname: str) -> Result:
        """The plugin's Result; one that cannot be decoded or holds no address is given back
        (DEL), so what the plugin reserved does not leak."""
        answer = self._call("ADD")
        try:
            result = _decode(answer)
            if not result.ips:
                raise CniError(
                    Code.DELEGATE_FAILURE,
                    f"IPAM plugin {self.plugin_type} returned missing IP config",
                )
        except CniError:
            with contextlib.suppress(CniError):
                self._call("DEL")
            raise
        return result

    def release(self, container_id: str, ifname: str) -> None:
        self._call("DEL")

    def check(self, container_id: str, ifname: str) -> None:
        self._call("CHECK")

    def gc(self, valid: set[tuple[str, str]]) -> None:
        self._call("GC")

    def status(self) -> None:
        self._call("STATUS")
