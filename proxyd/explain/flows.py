"""`kubectl knit flows`: the flow records of the nodes' daemons (proxyd/policy/flows.py),
filtered and printed.

From a laptop, each node's records are read through `kubectl exec` into the knit pod of the
node, which runs this same command with `--local` against the daemon's socket (root only,
proxyd/policy/flow_server.py) and prints the matching records as JSON lines. The kubectl
binary rather than the Python client's exec stream: a kubectl plugin runs beside kubectl by
construction, and kubectl's exec speaks every API server's streaming protocol and every
credential plugin of the user's kubeconfig. `kubectl knit explain --verify` reads the source
pod's records the same way, each node's reader run to its end (read_nodes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Any

from proxyd.policy.flow_server import read

KNIT_NAMESPACE = "kube-system"
KNIT_SELECTOR = "app.kubernetes.io/name=knit"
KNIT_CONTAINER = "knit"
"""Where deploy/kubernetes runs the daemon."""
READER = "kubectl knit flows: "
"""How the local reader's messages begin."""
READ_TIMEOUT = 60.0
"""Seconds for one node's records read at once (`kubectl knit explain --verify`)."""


@dataclass(frozen=True)
class Filter:
    node: str | None = None
    namespace: str | None = None
    pod: str | None = None
    """NAME, or NS/NAME."""
    verdict: str | None = None
    staged: bool = False
    """Only the connections staged policies would decide otherwise."""

    def matches(self, record: dict[str, Any]) -> bool:
        pods = [end["pod"] for end in (record["source"], record["destination"]) if end["pod"]]
        if self.node is not None and record["node"] != self.node:
            return False
        if self.staged and not record.get("staged"):
            return False
        if self.verdict is not None and record["verdict"] != self.verdict:
            return False
        if self.namespace is not None and all(p["namespace"] != self.namespace for p in pods):
            return False
        return self.pod is None or any(self._is_pod(p) for p in pods)

    def _is_pod(self, pod: dict[str, str]) -> bool:
        assert self.pod is not None
        namespace, _, name = self.pod.rpartition("/")
        return (
            pod["name"] == name
            and (not namespace or pod["namespace"] == namespace)
            and (self.namespace is None or pod["namespace"] == self.namespace)
        )

    def arguments(self) -> list[str]:
        """This filter as the command's flags, for the node's local reader."""
        flags = (("--node", self.node), ("--namespace", self.namespace), ("--pod", self.pod),
                 ("--verdict", self.verdict))  # fmt: skip
        words = [word for flag, value in flags if value is not None for word in (flag, value)]
        return [*words, "--staged"] if self.staged else words


class FlowsError(RuntimeError):
    """The records cannot be read; the message says why."""


def _end(end: dict[str, Any]) -> str:
    address = end["address"]
    shown = f"[{address}]" if ":" in address else address
    where = f"{shown}:{end['port']}" if end["port"] is not None else shown
    pod = end["pod"]
    return f"{pod['namespace']}/{pod['name']} {where}" if pod else where


def to_text(record: dict[str, Any]) -> str:
    """One line, as `hubble observe` prints one: time, node, direction, verdict, the ends, and
    what decided; then what staged policies would do, where they would decide otherwise (a
    daemon from before staged policies sends no `staged`)."""
    staged = record.get("staged")
    would = (
        f" [staged: would {staged['verdict']}: {staged['decidedBy']['reason']}]" if staged else ""
    )
    return (
        f"{record['time']} {record['node']} {record['direction']:<7} "
        f"{record['verdict'].upper():<5} {record['protocol']} {_end(record['source'])} -> "
        f"{_end(record['destination'])}: {record['decidedBy']['reason']}{would}"
    )


def print_records(records: Iterable[dict[str, Any]], output: str, out: IO[str]) -> None:
    for record in records:
        print(json.dumps(record) if output == "json" else to_text(record), file=out, flush=True)


def kubectl() -> str:
    """The kubectl binary: $KUBECTL, else the one on PATH (kubectl runs its plugins so)."""
    found = os.environ.get("KUBECTL") or shutil.which("kubectl")
    if not found:
        raise FlowsError("kubectl is not on PATH (or set KUBECTL): it reads each node's records")
    return found


def exec_command(
    binary: str, pod: str, chosen: Filter, follow: bool, kubeconfig: str | None
) -> list[str]:
    """The kubectl command that runs the local reader in one knit pod."""
    config = ["--kubeconfig", kubeconfig] if kubeconfig else []
    local = ["kubectl-knit", "flows", "--local", "-o", "json", *chosen.arguments()]
    return [
        binary, *config, "exec", "-n", KNIT_NAMESPACE, pod, "-c", KNIT_CONTAINER, "--",
        *local, *(["-f"] if follow else []),
    ]  # fmt: skip


Runner = Callable[[list[str]], Iterator[str]]
"""Runs a command and gives its output's lines as they come."""


def run_lines(command: list[str]) -> Iterator[str]:
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None
        yield from process.stdout
        if process.wait():
            raise FlowsError(f"{' '.join(command[:8])}... failed ({process.returncode})")


def run_captured(command: list[str]) -> Iterator[str]:
    """The command's output's lines once it has ended. If it fails, what the local reader
    said (kubectl exec adds `command terminated with exit code N` after it), else its
    error's last line."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=READ_TIMEOUT)
    except subprocess.TimeoutExpired as err:
        raise FlowsError(f"no answer within {READ_TIMEOUT:.0f} s") from err
    if done.returncode:
        said = done.stderr.strip().splitlines() or [f"{command[0]} failed ({done.returncode})"]
        own = [line for line in said if line.startswith(READER)]
        raise FlowsError((own or said)[-1].removeprefix(READER))
    yield from done.stdout.splitlines()


def read_nodes(
    commands: Mapping[str, list[str]], run: Runner = run_captured
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Each node's records, its reader run at once with the others'; and the nodes whose
    reader failed, with why."""

    def read(command: list[str]) -> list[dict[str, Any]] | str:
        try:
            return [json.loads(line) for line in run(command)]
        except (FlowsError, OSError, ValueError) as err:
            return str(err)

    with ThreadPoolExecutor(max(1, len(commands))) as pool:
        answers = dict(zip(commands, pool.map(read, commands.values()), strict=True))
    found = [r for answer in answers.values() if not isinstance(answer, str) for r in answer]
    return found, {node: answer for node, answer in answers.items() if isinstance(answer, str)}


def gather(
    commands: Sequence[list[str]], follow: bool, emit: Callable[[dict[str, Any]], None],
    run: Runner = run_lines,
) -> list[str]:  # fmt: skip
    """Runs each node's reader at once. Following, each record is emitted as it comes;
    otherwise all are emitted at the end, oldest first. Returns the readers' failures."""
    lock = threading.Lock()
    held: list[dict[str, Any]] = []
    failures: list[str] = []

    def read(command: list[str]) -> None:
        try:
            for line in run(command):
                record = json.loads(line)
                with lock:
                    emit(record) if follow else held.append(record)
        except (FlowsError, OSError, ValueError) as err:
            with lock:
                failures.append(str(err))

    threads = [threading.Thread(target=read, args=(c,), daemon=True) for c in commands]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for record in sorted(held, key=lambda r: str(r["time"])):
        emit(record)
    return failures


def local(socket: str, chosen: Filter, follow: bool, output: str) -> int:
    """Inside the knit pod: the records of this node's daemon."""
    try:
        print_records(filter(chosen.matches, read(socket, follow)), output, sys.stdout)
    except FileNotFoundError:
        print(
            f"{READER}no {socket}: this node's knit-proxyd keeps no flow records "
            "(no --flow-records-rate) or is not running",
            file=sys.stderr,
        )
        return 2
    except OSError as err:
        print(f"{READER}{socket}: {err}", file=sys.stderr)
        return 2
    return 0
