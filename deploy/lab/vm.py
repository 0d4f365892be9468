"""A node that is a virtual machine: Debian's own kernel (which has IPVS and SCTP, unlike a
development host's) under `qemu-system-x86_64 -accel tcg`, booted from deploy/lab/vm_image.py's
files, with knit's checkout mounted read-only at the same path as on the host.

Its one link is a tap device inside a network namespace this module creates (the VM's
"uplink": GATEWAY there, ADDRESS in the VM), so nothing of the host's own namespace changes.
Commands run through the VM's agent (deploy/lab/vm_agent.py) over that link: `run()` and
`spawn()` as on a namespace node. `booted()` powers the VM off (then kills qemu) and removes
the namespace however its block ends; the console log stays in the caller's folder.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import select
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.lab.controlplane import die_with_parent
from deploy.lab.netns import Netns, namespaces
from deploy.lab.paths import ROOT
from deploy.lab.relay import socket_in
from deploy.lab.vm_image import BootFiles, build

GATEWAY = "10.88.0.1"
ADDRESS = "10.88.0.2"
PREFIX = 24
AGENT_PORT = 7070
TAP = "tap0"
PYTHON = "python3"
"""The VM's interpreter (Debian's), knit's dependencies on its path."""


class VmError(RuntimeError):
    """The VM did not boot, or its agent did not answer."""


def _line(conn: socket.socket) -> dict[str, Any]:
    """One short answer line, read unbuffered: the connection's later bytes stay in it."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1)
        if not chunk:
            raise VmError("the VM's agent closed the connection without an answer")
        data += chunk
    answer: dict[str, Any] = json.loads(data)
    return answer


@dataclass
class VmProcess:
    """A process spawned in the VM; it ends when stop() closes its side of the connection."""

    pid: int
    log: str
    connection: socket.socket
    code: int | None = None

    def poll(self) -> int | None:
        """Its exit code once it has ended, else None."""
        if self.code is None and select.select([self.connection], [], [], 0)[0]:
            self.code = _line(self.connection)["code"]
        return self.code

    def stop(self) -> int:
        """End it (SIGTERM, then SIGKILL) unless it ended; its exit code."""
        code = self.poll()
        if code is None:
            with contextlib.suppress(OSError):
                self.connection.shutdown(socket.SHUT_WR)
            code = self.code = _line(self.connection)["code"]
        self.connection.close()
        return code


def _answer(stream: io.BufferedIOBase) -> dict[str, Any]:
    line = stream.readline()
    if not line:
        raise VmError("the VM's agent closed the connection without an answer")
    answer: dict[str, Any] = json.loads(line)
    return answer


@dataclass
class VmNode:
    uplink: Netns
    """The namespace holding the tap link: the VM's way to the host's test world."""
    console: Path
    qemu: subprocess.Popen[bytes]
    address: str = ADDRESS
    boot_seconds: float = 0.0
    processes: list[VmProcess] = field(default_factory=list)

    def _connect(self, timeout: float) -> socket.socket:
        return socket_in(
            self.uplink.name,
            lambda: socket.create_connection((self.address, AGENT_PORT), timeout=timeout),
        )

    def _ask(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        with self._connect(timeout) as conn, conn.makefile("rwb") as stream:
            stream.write(json.dumps(request).encode() + b"\n")
            stream.flush()
            return _answer(stream)

    def run(
        self,
        *argv: str,
        check: bool = True,
        stdin: str = "",
        env: dict[str, str] | None = None,
        cwd: str = "/",
        timeout: float = 60,
    ) -> subprocess.CompletedProcess[str]:
        """argv run in the VM, as subprocess.run with text output."""
        request = {
            "op": "run",
            "argv": list(argv),
            "stdin": base64.b64encode(stdin.encode()).decode(),
            "env": env or {},
            "cwd": cwd,
            "timeout": timeout,
        }
        answer = self._ask(request, timeout + 10)
        result = subprocess.CompletedProcess(
            list(argv),
            answer["code"],
            base64.b64decode(answer["stdout"]).decode(errors="replace"),
            base64.b64decode(answer["stderr"]).decode(errors="replace"),
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(
                result.returncode, result.args, result.stdout, result.stderr
            )
        return result

    def spawn(self, argv: list[str], log: str, env: dict[str, str] | None = None) -> VmProcess:
        """argv started in the VM, writing to the VM's file `log`; stopped by its stop() or
        when the VM powers off."""
        conn = self._connect(10)
        conn.sendall(
            json.dumps({"op": "spawn", "argv": argv, "log": log, "env": env or {}}).encode() + b"\n"
        )
        conn.settimeout(None)
        process = VmProcess(_line(conn)["pid"], log, conn)
        self.processes.append(process)
        return process

    def write(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self.run("mkdir", "-p", str(Path(path).parent))
        request = {
            "op": "write",
            "path": path,
            "data": base64.b64encode(data).decode(),
            "mode": mode,
        }
        self._ask(request, 30)

    def poweroff(self, timeout: float = 20) -> None:
        """Power off through the agent; kill qemu if it has not exited within timeout."""
        for process in self.processes:
            with contextlib.suppress(OSError, VmError):
                process.stop()
        if self.qemu.poll() is None:
            with contextlib.suppress(OSError, VmError):
                self._ask({"op": "poweroff"}, 5)
            try:
                self.qemu.wait(timeout)
            except subprocess.TimeoutExpired:
                self.qemu.kill()
                self.qemu.wait()


def qemu_argv(files: BootFiles, console: Path, memory_mib: int, cpus: int) -> list[str]:
    cmdline = (
        f"console=ttyS0 panic=-1 quiet knit.addr={ADDRESS}/{PREFIX} knit.gw={GATEWAY} "
        f"knit.src={ROOT} knit.port={AGENT_PORT}"
    )
    return [
        "qemu-system-x86_64", "-accel", "tcg", "-cpu", "max", "-smp", str(cpus),
        "-m", str(memory_mib), "-nodefaults", "-no-user-config", "-display", "none",
        "-no-reboot", "-serial", f"file:{console}",
        "-kernel", str(files.kernel), "-initrd", str(files.initrd), "-append", cmdline,
        "-netdev", f"tap,id=uplink,ifname={TAP},script=no,downscript=no",
        "-device", "virtio-net-pci,netdev=uplink",
        "-virtfs", f"local,path={ROOT},mount_tag=knit,security_model=none,readonly=on",
    ]  # fmt: skip


def _wait_ready(node: VmNode, began: float, timeout: float) -> None:
    """Until the agent answers; VmError at once if qemu exits, or after timeout."""
    while True:
        if node.qemu.poll() is not None:
            raise VmError(f"qemu exited ({node.qemu.returncode}); console: {node.console}")
        try:
            node.run("true", timeout=5)
            return
        except OSError as err:
            if time.monotonic() - began > timeout:
                raise VmError(f"no answer in {timeout:.0f}s; console: {node.console}") from err
        time.sleep(0.5)


@contextlib.contextmanager
def booted(
    folder: Path, memory_mib: int = 1536, cpus: int = 1, timeout: float = 120
) -> Iterator[VmNode]:
    """A VM node booted and answering; powered off, with its namespace removed, at the end.
    qemu dies with the thread that started it, should this process die first."""
    files = build()
    folder.mkdir(parents=True, exist_ok=True)
    console = folder / "console.log"
    with namespaces("vm") as make:
        uplink = make("uplink")
        uplink.run("ip", "tuntap", "add", "dev", TAP, "mode", "tap")
        uplink.run("ip", "address", "add", f"{GATEWAY}/{PREFIX}", "dev", TAP)
        uplink.run("ip", "link", "set", TAP, "up")
        began = time.monotonic()
        with (folder / "qemu.log").open("ab") as log:
            qemu = subprocess.Popen(
                ["ip", "netns", "exec", uplink.name, *qemu_argv(files, console, memory_mib, cpus)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,
            )
        node = VmNode(uplink, console, qemu)
        try:
            _wait_ready(node, began, timeout)
            node.boot_seconds = time.monotonic() - began
            yield node
        finally:
            node.poweroff()


def main() -> None:
    """Boot the VM, print its boot time and kernel, power it off (a smoke check)."""
    folder = ROOT / "build" / "vm" / f"smoke-{os.getpid()}"
    with booted(folder) as node:
        print(f"ready in {node.boot_seconds:.1f}s: {node.run('uname', '-r').stdout.strip()}")
    print(f"console: {folder / 'console.log'}")


if __name__ == "__main__":
    main()
