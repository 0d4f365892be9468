"""The command agent of the VM node, its PID 1 (started by deploy/lab/vm_init.sh; standard
library only, it runs on the VM's Debian Python). It listens on ADDRESS:PORT, the VM's end of
its tap link, which outside the VM only the test's namespace at the other end reaches;
deploy/lab/vm.py is its client.

One JSON request line per connection, answered by JSON lines (bytes travel base64-coded):

- `run` {argv, stdin, env, cwd, timeout}: one answer {code, stdout, stderr} (code -1: timed out).
- `spawn` {argv, log, env}: {pid} at once, the process writing to the VM's file `log`; the
  process is ended (SIGTERM to its group, SIGKILL 10 s later) when the client closes its side
  of the connection, and the last answer is {code} when it has ended either way.
- `write` {path, data, mode}: a file written; {code: 0}.
- `poweroff`: {code: 0}, then the VM powers off.
"""

from __future__ import annotations

import base64
import ctypes
import json
import os
import select
import signal
import socketserver
import subprocess
import sys
from typing import Any

_POWER_OFF = 0x4321FEDC
"""reboot(2)'s LINUX_REBOOT_CMD_POWER_OFF."""


def _bytes(text: str) -> bytes:
    return base64.b64decode(text)


def _text(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _end(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process's group, SIGKILL if it still runs 10 s later."""
    for signum, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


class Handler(socketserver.StreamRequestHandler):
    def answer(self, message: dict[str, Any]) -> None:
        self.wfile.write(json.dumps(message).encode() + b"\n")
        self.wfile.flush()

    def handle(self) -> None:
        request = json.loads(self.rfile.readline())
        env = {**os.environ, **request.get("env", {})}
        op = request["op"]
        if op == "run":
            self.run(request, env)
        elif op == "spawn":
            self.spawn(request, env)
        elif op == "write":
            with open(request["path"], "wb") as out:
                out.write(_bytes(request["data"]))
            os.chmod(request["path"], request["mode"])
            self.answer({"code": 0})
        elif op == "poweroff":
            self.answer({"code": 0})
            os.sync()
            ctypes.CDLL(None, use_errno=True).reboot(_POWER_OFF)

    def run(self, request: dict[str, Any], env: dict[str, str]) -> None:
        try:
            proc = subprocess.run(
                request["argv"],
                input=_bytes(request.get("stdin", "")),
                capture_output=True,
                env=env,
                cwd=request.get("cwd") or "/",
                timeout=request.get("timeout", 60),
                check=False,
                start_new_session=True,
            )
        except subprocess.TimeoutExpired as err:
            self.answer({"code": -1, "stdout": _text(err.stdout or b""), "stderr": ""})
            return
        except OSError as err:
            self.answer({"code": 127, "stdout": "", "stderr": _text(str(err).encode())})
            return
        self.answer(
            {"code": proc.returncode, "stdout": _text(proc.stdout), "stderr": _text(proc.stderr)}
        )

    def spawn(self, request: dict[str, Any], env: dict[str, str]) -> None:
        with open(request["log"], "ab") as log:
            proc = subprocess.Popen(
                request["argv"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.answer({"pid": proc.pid})
        while proc.poll() is None:
            if select.select([self.connection], [], [], 0.2)[0] and not self.connection.recv(1):
                _end(proc)
        self.answer({"code": proc.returncode})


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def main() -> None:
    with Server((sys.argv[1], int(sys.argv[2])), Handler) as server:
        with open("/proc/uptime") as clock:
            uptime = clock.read().split()[0]
        print(f"knit-vm: agent listening at {uptime}s of uptime", flush=True)
        server.serve_forever()


if __name__ == "__main__":
    main()
