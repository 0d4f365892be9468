"""A TCP connection held open from inside a namespace (echo.py's `hold`), to prove what
happens to a connection that was open before a change."""

from __future__ import annotations

import select
import subprocess
import sys
import time
from types import TracebackType
from typing import IO

from deploy.lab.netns import ECHO


class HeldConnection:
    """Connects at once and reads the server's greeting; `exchange` sends a line and reads
    its echo. The server answers strictly line for line, so nothing is left unread between
    exchanges."""

    def __init__(self, netns: str, host: str, port: int, timeout: float = 10.0) -> None:
        argv = ["ip", "netns", "exec", netns, sys.executable, str(ECHO), "hold", host, str(port)]
        self._process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._process.stdin is not None and self._process.stdout is not None
        self._to: IO[str] = self._process.stdin
        self._from: IO[str] = self._process.stdout
        greeting = self._line(timeout)
        if greeting is None:
            self.close()
            raise TimeoutError(f"no greeting from {host}:{port} in {netns}")
        self.greeting = greeting

    def _line(self, timeout: float) -> str | None:
        if not select.select([self._from], [], [], timeout)[0]:
            return None
        return self._from.readline().strip() or None

    def exchange(self, text: str = "ping", timeout: float = 2.0) -> bool:
        """Whether the line came back within `timeout` seconds."""
        try:
            self._to.write(text + "\n")
            self._to.flush()
        except BrokenPipeError:  # the client gave up on the connection
            return False
        return self._line(timeout) == text

    def cut_after(self, since: float, limit: float, every: float = 0.05) -> float:
        """Exchanges until one goes unanswered; seconds from `since` (time.monotonic()) to the
        exchange that was not answered. TimeoutError if all are answered for `limit` s."""
        while time.monotonic() - since < limit:
            sent = time.monotonic()
            if not self.exchange(timeout=1.0):
                return sent - since
            time.sleep(every)
        raise TimeoutError(f"still answered {limit} s after the change")

    def close(self) -> None:
        self._process.kill()
        self._process.wait()

    def __enter__(self) -> HeldConnection:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
