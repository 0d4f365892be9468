"""Any IPAM type other than host-local: exec that plugin from CNI_PATH, as the spec says.

The plugin may run in the node daemon, with its capabilities (cni.server narrows CNI_PATH to
the daemon's bin dirs), so it gets no more than the spec gives a plugin: the call's own CNI_*
variables and a minimal PATH, never the process's environment; and a deadline, past which it
is killed with everything it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from cni.errors import CniError, Code
from cni.invocation import SPEC_VARIABLES, Invocation, call_deadline
from cni.paths import inside
from cni.result import Result

# For one delegated call. An IPAM plugin answers in milliseconds (host-local) to seconds (dhcp
# waits on its daemon's lease); an ADD is at most three of them (ADD, then a DEL giving back
# what a failed ADD or attachment held), well within kubelet's 2-minute runtime request.
DEADLINE = 20.0
MINIMAL_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class TimedOut(CniError):
    """The delegated plugin was killed at its deadline, whatever it had done by then."""


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
        env = {k: v for k, v in self.invocation.variables.items() if k in SPEC_VARIABLES}
        env.update(CNI_COMMAND=command, PATH=MINIMAL_PATH)
        netns_fd = self.invocation.netns_fd
        if netns_fd is not None:
            # The fast path's daemon may not resolve the runtime's CNI_NETNS, and so neither
            # may its child: the child gets the namespace the plugin opened, by descriptor.
            env["CNI_NETNS"] = f"/proc/self/fd/{netns_fd}"
        timeout = self._timeout(command)
        # A session of its own, so that the deadline kills what the plugin started too.
        with subprocess.Popen(
            [self._executable()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            pass_fds=() if netns_fd is None else (netns_fd,),
            start_new_session=True,
        ) as proc:
            try:
                stdout, stderr = proc.communicate(self.stdin, timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the leader is unreaped: its group exists
                proc.wait()
                raise TimedOut(
                    Code.DELEGATE_FAILURE,
                    f"IPAM plugin {self.plugin_type} {command} did not answer in "
                    f"{timeout:.2g} s: killed",
                ) from None
        if proc.returncode == 0:
            return stdout
        try:
            answer = json.loads(stdout)
            raise CniError(int(answer["code"]), answer.get("msg", ""), answer.get("details", ""))
        except (ValueError, KeyError, TypeError):
            raise CniError(
                Code.DELEGATE_FAILURE,
                f"IPAM plugin {self.plugin_type} {command} failed",
                (stderr or stdout).decode(errors="replace"),
            ) from None

    @staticmethod
    def _timeout(command: str) -> float:
        """DEADLINE, or what is left of the call's deadline when that comes sooner. A DEL
        always gets DEADLINE: it gives back what a pod or a failed ADD holds, and cutting it
        short would leak the address."""
        end = call_deadline.get()
        if end is None or command == "DEL":
            return DEADLINE
        return max(0.0, min(DEADLINE, end - time.monotonic()))

    def add(self, container_id: str, ifname: str) -> Result:
        """The plugin's Result. An ADD killed at its deadline, or whose answer cannot be
        decoded or holds no address, is given back (DEL): the plugin may have reserved an
        address, which must not leak. (One that answers an error has cleaned up itself.)"""
        try:
            answer = self._call("ADD")
        except TimedOut:
            self._give_back()
            raise
        try:
            result = _decode(answer)
            if not result.ips:
                raise CniError(
                    Code.DELEGATE_FAILURE,
                    f"IPAM plugin {self.plugin_type} returned missing IP config",
                )
        except CniError:
            self._give_back()
            raise
        return result

    def _give_back(self) -> None:
        with contextlib.suppress(CniError):
            self._call("DEL")

    def release(self, container_id: str, ifname: str) -> None:
        self._call("DEL")

    def check(self, container_id: str, ifname: str) -> None:
        self._call("CHECK")

    def gc(self, valid: set[tuple[str, str]]) -> None:
        self._call("GC")

    def status(self) -> None:
        self._call("STATUS")
