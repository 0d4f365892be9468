"""Chaos under churn on the lab: faults at random moments while the cluster changes, steady
clients counting what they lose, and an audit once it is quiet again.

- **Churn** (deploy/lab/churn.py, a thread): a Deployment scaled between 0 and a maximum
  across the nodes, a Service's port changed, Services and NetworkPolicies over the churned
  pods made and deleted.
- **Faults** (deploy/lab/faults.py), one at a time on a random node, each kind in turn:
  knit-proxyd killed (SIGKILL; kubelet starts it again), knit's pod deleted (the DaemonSet
  makes another), containerd restarted, kubelet restarted, kube-apiserver restarted, the node
  rebooted (deploy/lab/reboot.py). After each, the run waits for the node to recover, then a
  few seconds more, before the next.
- **Steady clients** in every node's network namespace (deploy/lab/steady.py): HTTP to a
  stable Service's ClusterIP and to the next node's NodePort, UDP from one source port to the
  ClusterIP, and one HTTP connection held open through each of the ClusterIP and the NodePort.
  The Service's pods (a DaemonSet) are isolated by a NetworkPolicy that allows everything, so a
  policy that fails to hold shows as failed requests.
- **Audit** (deploy/lab/audit.py), once the churn stopped and the cluster settled: no leaked
  address, veth, rule or conntrack entry, every pod with its addresses and answering from every
  node, knit-proxyd's threads, file descriptors and memory back to their level before the run.

The report gives, per fault kind: how many were injected, the steady clients' failed requests
in the windows that followed them (a window runs from one fault to the next), the longest time
a client went without an answer, and the held connections kept. `make chaos` runs it long in a
lab of each proxy mode; `make test` runs it short (tests/cluster/test_under_chaos.py).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from deploy.lab import audit
from deploy.lab.churn import HTTP_PORT, NAMESPACE, Churn, policies, setup
from deploy.lab.cluster import PYTHON
from deploy.lab.faults import FAULT_KINDS, Fault, Footprint, footprint, footprint_growth, inject
from deploy.lab.lab import PROXY_MODES, Lab, is_ready
from deploy.lab.netns import unique_name
from deploy.lab.paths import ROOT
from deploy.lab.process import eventually, terminate

CHURN_ONLY = "churn alone"
LATE_ATTEMPT = re.compile(r"/answer of attempt (\d+)$")
"""A UDP attempt's failure, naming the attempt a later `late N` line may answer."""
REACHABLE = 30.0
"""Seconds the workload's pods have to answer from every node once the audit is clean."""
SETTLE_PODS = 180.0
"""Seconds the workload's pods have to be Ready, and gone if deleted, once the churn stopped."""


# ---------------------------------------------------------------- steady clients


@dataclass(frozen=True)
class Client:
    node: str
    kind: str
    """http, udp or hold (deploy/lab/steady.py)."""
    target: str
    log: Path

    @property
    def name(self) -> str:
        return f"{self.node} {self.kind} {self.target}"

    def lines(self) -> list[tuple[float, str]]:
        """(time, outcome) of every attempt logged, in order; a line cut short by the client's
        end is passed over."""
        return [(stamp, outcome) for stamp, outcome, _ in self._attempts()]

    def errors(self, start: float, end: float) -> Counter[str]:
        """How the attempts between start and end failed (deploy/lab/steady.py's ERROR)."""
        return Counter(
            error
            for stamp, outcome, error in self._attempts()
            if outcome == "failed" and start <= stamp < end
        )

    def _attempts(self) -> list[tuple[float, str, str]]:
        """(time, outcome, error) of every attempt; a failed one whose answer came after all
        (a UDP attempt's `late N`) is `late`."""
        lines = [line.split(" ", 2) for line in self.log.read_text().splitlines()]
        answered = {said[2].split()[0] for said in lines if len(said) == 3 and said[1] == "late"}
        found = []
        for stamp, outcome, *rest in (said for said in lines if len(said) >= 2):
            error = rest[0] if rest else ""
            if outcome == "failed" and (late := LATE_ATTEMPT.search(error)):
                outcome = "late" if late[1] in answered else outcome
            elif outcome not in ("ok", "failed", "broken"):
                continue  # a `late N` line, or one cut short by the client's end
            found.append((float(stamp), outcome, error.partition(" ")[0]))
        return found


class SteadyClients:
    """The steady clients of every node, started and stopped per node (a reboot takes a
    node's network namespace, and with it its clients' sockets, away)."""

    def __init__(self, lab: Lab, folder: Path) -> None:
        self.lab, self.folder = lab, folder
        self.clients: list[Client] = []
        self._pids: dict[str, list[int]] = {}
        service = json.loads(lab.kubectl("-n", NAMESPACE, "get", "service", "stable", "-o", "json"))
        self.cluster_ip = service["spec"]["clusterIP"]
        ports = {port["name"]: port for port in service["spec"]["ports"]}
        self.node_port = ports["http"]["nodePort"]
        self.http_port, self.udp_port = ports["http"]["port"], ports["udp"]["port"]

    def start(self, node: str) -> None:
        names = list(self.lab.nodes)
        following = self.lab.nodes[names[(names.index(node) + 1) % len(names)]]
        targets = (
            ("http", [self.cluster_ip, str(self.http_port)]),
            ("http", [following.addresses[0], str(self.node_port)]),
            ("udp", [self.cluster_ip, str(self.udp_port)]),
            ("hold", [self.cluster_ip, str(self.http_port)]),
            ("hold", [following.addresses[0], str(self.node_port)]),
        )
        pids = []
        for kind, argv in targets:
            client = Client(node, kind, " ".join(argv), self.folder / f"{unique_name('c')}.log")
            netns = self.lab.nodes[node].machine.netns
            command = ["ip", "netns", "exec", netns, PYTHON, "-m", "deploy.lab.steady"]
            pids.append(self.lab.network.spawn([*command, kind, *argv], client.log))
            self.clients.append(client)
        self._pids[node] = pids

    def stop(self, node: str) -> None:
        for pid in self._pids.pop(node, []):
            terminate(pid)

    def served_from(self, node: str) -> bool:
        """The stable Service's endpoint on node is its pod there, Ready: after a reboot, the
        endpoint of the pod's old address, gone with the node's network, is replaced."""
        stable = ("-n", NAMESPACE, "-l", "app=stable")
        pods = audit.items(self.lab, "pods", *stable, "--field-selector", f"spec.nodeName={node}")
        ready = [pod["status"].get("podIP") for pod in pods if is_ready(pod)]
        service = ("-n", NAMESPACE, "-l", "kubernetes.io/service-name=stable")
        slices = audit.items(self.lab, "endpointslices", *service)
        endpoints = {
            (address, bool(endpoint.get("conditions", {}).get("ready")))
            for found in slices
            if found["addressType"] == "IPv4"
            for endpoint in found.get("endpoints") or []
            if endpoint.get("nodeName") == node
            for address in endpoint["addresses"]
        }
        return len(ready) == 1 and endpoints == {(ready[0], True)}

    def stop_all(self) -> None:
        for node in list(self._pids):
            self.stop(node)


# ---------------------------------------------------------------- the report


@dataclass
class KindReport:
    injected: int = 0
    failed_requests: int = 0
    requests: int = 0
    longest_without_answer: float = 0.0
    held_connections: int = 0
    held_kept: int = 0
    recovery_seconds: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    """The failed requests by how they failed (TimeoutError, ConnectionRefusedError, ...)."""
    late_answers: int = 0
    """Requests answered after their timeout: slow, not lost, so not failed."""


def _windows(faults: list[Fault], began: float, ended: float) -> Iterator[tuple[str, float, float]]:
    """(kind, start, end) of every window: the churn alone before the first fault, then each
    fault until the next (the last until the churn ended)."""
    starts = [began, *(fault.began for fault in faults)]
    kinds = [CHURN_ONLY, *(fault.kind for fault in faults)]
    yield from zip(kinds, starts, [*starts[1:], ended], strict=True)


def _longest_without_answer(lines: list[tuple[float, str]], start: float, end: float) -> float:
    """The longest wait for an answer across unanswered attempts in the window: from the answer
    before them (or the window's start) to the answer after them (or the window's end)."""
    last_answer, longest, failing = start, 0.0, False
    for stamp, outcome in lines:
        if not start <= stamp < end:
            continue
        if outcome == "ok":
            if failing:
                longest = max(longest, stamp - last_answer)
            last_answer, failing = stamp, False
        else:
            failing = True
    return max(longest, end - last_answer) if failing else longest


def report(
    faults: list[Fault], clients: list[Client], began: float, ended: float
) -> dict[str, KindReport]:
    kinds: dict[str, KindReport] = {kind: KindReport() for kind in (CHURN_ONLY, *FAULT_KINDS)}
    for fault in faults:
        kinds[fault.kind].injected += 1
        kinds[fault.kind].recovery_seconds.append(round(fault.recovered_after, 1))
    logs = [(client, client.lines()) for client in clients]
    for kind, start, end in _windows(faults, began, ended):
        entry = kinds[kind]
        for client, lines in logs:
            inside = [outcome for stamp, outcome in lines if start <= stamp < end]
            if not inside:
                continue
            if client.kind == "hold":
                entry.held_connections += 1
                entry.held_kept += "broken" not in inside
                continue
            entry.requests += len(inside)
            entry.failed_requests += inside.count("failed")
            entry.late_answers += inside.count("late")
            for error, count in client.errors(start, end).items():
                entry.errors[error] = entry.errors.get(error, 0) + count
            longest = _longest_without_answer(lines, start, end)
            entry.longest_without_answer = max(entry.longest_without_answer, round(longest, 2))
    return kinds


def show(kinds: dict[str, KindReport]) -> str:
    rows = [
        f"{'window':26} {'n':>3} {'failed/requests':>16} {'longest gap':>12} {'held kept':>10}"
        f"  recovery s, failures by error, late answers"
    ]
    for kind, entry in kinds.items():
        errors = ", ".join(f"{error or '?'} {count}" for error, count in entry.errors.items())
        if entry.late_answers:
            errors += f"{', ' if errors else ''}late {entry.late_answers}"
        rows.append(
            f"{kind:26} {entry.injected:3} {entry.failed_requests:>7}/{entry.requests:<8} "
            f"{entry.longest_without_answer:11.2f}s "
            f"{entry.held_kept:>4}/{entry.held_connections:<5}  {entry.recovery_seconds}"
            + (f"; {errors}" if errors else "")
        )
    return "\n".join(rows)


# ---------------------------------------------------------------- the run


@dataclass
class Outcome:
    mode: str
    seconds: float
    churn_changes: int
    churn_refused: int
    faults: list[Fault]
    kinds: dict[str, KindReport]
    problems: list[str]
    footprints: dict[str, tuple[Footprint, Footprint]]

    def growth(self) -> list[str]:
        return [
            f"{node}: {grown}"
            for node, (before, after) in self.footprints.items()
            for grown in footprint_growth(before, after)
        ]

    def as_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "seconds": round(self.seconds),
            "churn": {"changes": self.churn_changes, "refused": self.churn_refused},
            "faults": [asdict(fault) for fault in self.faults],
            "windows": {kind: asdict(entry) for kind, entry in self.kinds.items()},
            "problems": self.problems,
            "footprint": {
                node: {"before": asdict(before), "after": asdict(after)}
                for node, (before, after) in self.footprints.items()
            },
        }


def _quiet(lab: Lab, settle: float) -> list[str]:
    """The churn's policies deleted, every node and pod Ready, then the audit's problems: none
    once the cluster settled, the last ones found if it did not within `settle` seconds; and
    then every pod of the workload answering from every node."""
    try:
        lab.kubectl("-n", NAMESPACE, "delete", "networkpolicy", *policies(), "--ignore-not-found")
        lab.wait_ready()
    except (RuntimeError, TimeoutError) as err:
        return [f"the cluster did not settle: {err}"]
    # polled rather than `kubectl wait --all`, which fails when a pod it waits for goes away
    pending = partial(audit.unready, lab, NAMESPACE)
    try:
        eventually(lambda: not pending(), SETTLE_PODS, "every pod Ready", interval=2)
    except TimeoutError:
        return [f"a pod not Ready after {SETTLE_PODS:.0f} s: {pod}" for pod in pending()]
    try:
        eventually(lambda: audit.settled(lab), settle, "the audit clean")
    except TimeoutError:
        return audit.problems(lab)
    # asked again, and reported only if it never answers: a pod given an address the churn
    # freed a moment ago can go unanswered for a few seconds (seen once, over IPv6), likely
    # while a neighbour entry still names the old pod's MAC (the plugin announces no address)
    unanswered = partial(audit.unreachable, lab, NAMESPACE, HTTP_PORT)
    try:
        eventually(lambda: not unanswered(), REACHABLE, "every pod answering", interval=1)
    except TimeoutError:
        return unanswered()
    return []


def run(
    lab: Lab,
    folder: Path,
    *,
    seconds: float,
    max_replicas: int,
    seed: int | None = None,
    kinds: tuple[str, ...] = FAULT_KINDS,
    gap: tuple[float, float] = (3.0, 8.0),
) -> Outcome:
    """Churn and faults for `seconds` (at least one fault of each kind), then the audit."""
    rng = random.Random(seed)
    setup(lab, folder)
    footprints_before = {node: footprint(lab, node) for node in lab.nodes}
    clients = SteadyClients(lab, folder)
    for node in lab.nodes:
        clients.start(node)
    churn = Churn(lab, folder, rng, max_replicas)
    faults: list[Fault] = []
    problems: list[str] = []
    began, start = time.time(), time.monotonic()
    churn.start()
    try:
        time.sleep(rng.uniform(*gap))
        turn: list[str] = []
        while len(faults) < len(kinds) or time.monotonic() - start < seconds:
            if not turn:
                turn = rng.sample(kinds, len(kinds))
            kind, node = turn.pop(), rng.choice(list(lab.nodes))
            try:
                faults.append(inject(lab, kind, node, clients))
            except TimeoutError as err:
                # a node that does not recover ends the faults; the audit says what it left
                problems.append(f"{kind} on {node}: {err}")
                break
            time.sleep(rng.uniform(*gap))
    finally:
        churn.stop()
        ended = time.time()
        clients.stop_all()
    problems += _quiet(lab, 120)
    footprints = {}
    for node, before in footprints_before.items():
        try:
            footprints[node] = (before, footprint(lab, node))
        except RuntimeError as err:
            problems.append(str(err))
    kinds_report = report(faults, clients.clients, began, ended)
    try:
        lab.kubectl("delete", "namespace", NAMESPACE, "--timeout=120s", timeout=130)
    except RuntimeError:
        late = "the workload's namespace not deleted within 120 s"
        problems += [f"{late}: {pod}" for pod in audit.unready(lab, NAMESPACE)] or [late]
    return Outcome(
        lab.mode,
        ended - began,
        churn.made,
        churn.refused,
        faults,
        kinds_report,
        problems,
        footprints,
    )


RESULTS = ROOT / "build" / "chaos"


def save(outcome: Outcome, folder: Path) -> Path:
    """The outcome as FOLDER/chaos.json, and its report printed."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "chaos.json"
    path.write_text(json.dumps(outcome.as_json(), indent=2))
    print(
        f"\n{outcome.mode}: {len(outcome.faults)} faults in {outcome.seconds:.0f} s, churn "
        f"{outcome.churn_changes} changes ({outcome.churn_refused} refused)"
    )
    print(show(outcome.kinds))
    for problem in outcome.problems + outcome.growth():
        print(f"  PROBLEM {problem}")
    print(f"written to {path}")
    return path


def keep_logs(lab: Lab, folder: Path) -> None:
    """Each node's kubelet, containerd and knit container logs copied into folder, which the
    lab's removal leaves."""
    for name, node in lab.nodes.items():
        into = folder / name
        into.mkdir(parents=True, exist_ok=True)
        for log in (node.folder / "kubelet.log", node.folder / "containerd.log"):
            if log.exists():
                shutil.copy(log, into)
        for pod in (node.folder / "var/log/pods").glob("kube-system_knit-*"):
            shutil.copytree(pod, into / pod.name, dirs_exist_ok=True)
    print(f"the nodes' logs are kept in {folder}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", default=",".join(PROXY_MODES))
    parser.add_argument("--minutes", type=float, default=15.0, help="per proxy mode")
    parser.add_argument("--max-replicas", type=int, default=30)
    parser.add_argument("--seed", type=int)
    options = parser.parse_args()
    failed = False
    for mode in options.modes.split(","):
        folder = RESULTS / f"{datetime.now(UTC):%Y-%m-%dT%H%M}-{mode}"
        lab = Lab(unique_name("knit-chaos"), folder / "lab", mode)
        try:
            lab.up()
            outcome = run(
                lab,
                folder / "run",
                seconds=options.minutes * 60,
                max_replicas=options.max_replicas,
                seed=options.seed,
            )
            if outcome.problems or outcome.growth():
                keep_logs(lab, folder / "logs")
        except BaseException:
            keep_logs(lab, folder / "logs")
            raise
        finally:
            lab.down()
        save(outcome, folder)
        failed |= bool(outcome.problems or outcome.growth())
    if failed:
        raise SystemExit("the audit found problems (above)")


if __name__ == "__main__":
    main()
