"""Processes for the lab, the tests and the benches: commands whose failure is an error
that says what failed, long-lived processes started detached from the caller and ended with
their whole group, and waiting for a condition with a deadline."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from deploy.lab.paths import ROOT

T = TypeVar("T")


def sh(*argv: str, check: bool = True, timeout: float = 60) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def in_ns(ns: str, *argv: str, check: bool = True, timeout: float = 60) -> str:
    return sh("ip", "netns", "exec", ns, *argv, check=check, timeout=timeout)


def detach(
    argv: list[str],
    log: Path,
    env: dict[str, str] | None = None,
    preexec: Callable[[], None] | None = None,
) -> int:
    """Start argv in a session of its own, from the project's root with the project importable,
    writing to log; returns its pid (the process outlives this one)."""
    with log.open("ab") as out:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
            env={**os.environ, **checkout_path(), **(env or {})},
            preexec_fn=preexec,
        )
    return proc.pid


def checkout_path() -> dict[str, str]:
    """PYTHONPATH for a child Python that imports from this checkout: the checkout, then what
    this environment's PYTHONPATH already names (a VM node's dependencies)."""
    inherited = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(ROOT), *([inherited] if inherited else [])])}


SLOWNESS = float(os.environ.get("KNIT_SLOWNESS", "1"))
"""How many times slower than the development machine this one runs: eventually()'s timeouts
are multiplied by it. The VM node's tests, under qemu's TCG, run the namespace tests with 5."""


def eventually(
    check: Callable[[], T | None],
    timeout: float = 15,
    what: str = "condition",
    interval: float = 0.2,
) -> T:
    """The first truthy result of check(), tried every `interval` seconds; TimeoutError naming
    the last error after timeout (times SLOWNESS)."""
    timeout *= SLOWNESS
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except Exception as err:
            last = err
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s (last error: {last!r})")
        time.sleep(interval)


def _gone(pid: int) -> bool:
    """Whether process pid has ended (reaping it if it is our child)."""
    try:
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return True
    except ChildProcessError:
        pass
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, IndexError):
        return True
    return state == "Z"  # ended; its parent (init, once the lab exited) reaps it later


def terminate(pid: int) -> None:
    if not pid:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not _gone(pid):
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            deadline += 10
        time.sleep(0.02)


def exit_on_termination() -> None:
    """Make SIGTERM and SIGHUP end this process through SystemExit, so that its finally
    blocks and context managers remove the namespaces, processes and files it made (by
    default these signals end the interpreter without running them)."""
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda number, _: sys.exit(128 + number))
