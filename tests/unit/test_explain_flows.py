"""`kubectl knit flows`: filters, the lines it prints, the kubectl exec it runs per node, the
records of several nodes gathered, and the local reader inside the knit pod."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import V1ObjectMeta, V1Pod, V1PodList, V1PodSpec, V1PodStatus

from proxyd.explain import cli, flows
from proxyd.policy import flow_server
from proxyd.policy.flows import Ring


def record(
    time: str = "2026-01-02T03:04:05.678Z",
    node: str = "n1",
    verdict: str = "deny",
    source: tuple[str, str] | None = ("y", "client"),
    destination: tuple[str, str] | None = ("x", "web"),
) -> dict[str, Any]:
    def end(address: str, port: int, pod: tuple[str, str] | None) -> dict[str, Any]:
        named = None if pod is None else {"namespace": pod[0], "name": pod[1]}
        return {"address": address, "port": port, "pod": named}

    return {
        "time": time, "node": node, "direction": "ingress", "verdict": verdict,
        "protocol": "TCP", "source": end("10.0.2.20", 40000, source),
        "destination": end("fd00::1", 80, destination), "chain": "ingress-X", "rule": None,
        "decidedBy": {"kind": "NetworkPolicy", "reason": "isolated by NetworkPolicy deny-all; "
                      "no rule allows"},
    }  # fmt: skip


def test_filters_by_node_verdict_namespace_and_pod_at_either_end() -> None:
    one = record()
    assert flows.Filter().matches(one)
    assert flows.Filter(node="n1", verdict="deny").matches(one)
    assert not flows.Filter(node="n2").matches(one)
    assert not flows.Filter(verdict="allow").matches(one)
    assert flows.Filter(namespace="y").matches(one) and flows.Filter(namespace="x").matches(one)
    assert not flows.Filter(namespace="z").matches(one)
    assert flows.Filter(pod="web").matches(one) and flows.Filter(pod="x/web").matches(one)
    assert not flows.Filter(pod="y/web").matches(one)
    assert not flows.Filter(namespace="y", pod="web").matches(one), "web is in x"
    assert not flows.Filter(namespace="x").matches(record(source=None, destination=None))


def test_a_staged_decision_is_printed_after_the_enforced_one_and_can_be_filtered() -> None:
    would = {"verdict": "deny", "decidedBy": {"kind": "NetworkPolicy", "reason": "isolated by "
             "NetworkPolicy deny-all; no rule allows"}}  # fmt: skip
    allowed = record(verdict="allow") | {
        "decidedBy": {"kind": "Default", "reason": "not isolated"}, "staged": would,
    }  # fmt: skip
    assert flows.to_text(allowed).endswith(
        "ALLOW TCP y/client 10.0.2.20:40000 -> x/web [fd00::1]:80: not isolated "
        "[staged: would deny: isolated by NetworkPolicy deny-all; no rule allows]"
    )
    assert flows.Filter(staged=True).matches(allowed)
    assert not flows.Filter(staged=True).matches(record() | {"staged": None})
    assert not flows.Filter(staged=True).matches(record()), "a daemon from before: no staged"
    assert "staged" not in flows.to_text(record())
    chosen = flows.Filter(verdict="allow", staged=True)
    assert chosen.arguments() == ["--verdict", "allow", "--staged"]
    parsed = cli._arguments().parse_args(["flows", "--local", *chosen.arguments()])
    assert parsed.staged and parsed.verdict == "allow"


def test_a_filter_passes_on_to_the_nodes_reader_as_flags() -> None:
    chosen = flows.Filter("n1", "x", "x/web", "deny")
    command = flows.exec_command("/bin/kubectl", "knit-abc", chosen, True, "/k.yaml")
    assert command == [
        "/bin/kubectl", "--kubeconfig", "/k.yaml", "exec", "-n", "kube-system", "knit-abc",
        "-c", "knit", "--", "kubectl-knit", "flows", "--local", "-o", "json",
        "--node", "n1", "--namespace", "x", "--pod", "x/web", "--verdict", "deny", "-f",
    ]  # fmt: skip
    parsed = cli._arguments().parse_args(command[command.index("flows") :])
    assert (parsed.node, parsed.namespace, parsed.pod, parsed.verdict) == (
        "n1",
        "x",
        "x/web",
        "deny",
    )
    assert parsed.local and parsed.follow and parsed.output == "json"


def test_a_record_in_one_line() -> None:
    assert flows.to_text(record()) == (
        "2026-01-02T03:04:05.678Z n1 ingress DENY  TCP y/client 10.0.2.20:40000 -> "
        "x/web [fd00::1]:80: isolated by NetworkPolicy deny-all; no rule allows"
    )


def test_the_nodes_records_are_gathered_oldest_first_and_failures_said() -> None:
    outputs = {
        "n1": [json.dumps(record(time="2026-01-02T03:04:07.000Z"))],
        "n2": [json.dumps(record(time="2026-01-02T03:04:06.000Z", node="n2"))],
    }

    def run(command: list[str]) -> Iterator[str]:
        if command[0] == "broken":
            raise flows.FlowsError("exec failed")
        yield from outputs[command[0]]

    emitted: list[dict[str, Any]] = []
    failures = flows.gather([["n1"], ["n2"], ["broken"]], False, emitted.append, run)
    assert [r["node"] for r in emitted] == ["n2", "n1"]
    assert failures == ["exec failed"]
    emitted.clear()
    assert flows.gather([["n1"]], True, emitted.append, run) == []
    assert len(emitted) == 1


def test_the_local_reader_prints_the_daemons_matching_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(flow_server, "peer", lambda _: (1, 0))
    ring = Ring()
    ring.add(record(verdict="allow"))
    ring.add(record())
    server = flow_server.FlowServer(str(tmp_path / "flows.sock"), ring)
    try:
        argv = ["flows", "--local", "--socket", server.path, "--verdict", "deny", "-o", "json"]
        assert cli.main(argv) == 0
    finally:
        server.close()
    assert [json.loads(line) for line in capsys.readouterr().out.splitlines()] == [record()]
    assert cli.main(["flows", "--local", "--socket", str(tmp_path / "none.sock")]) == 2
    assert "keeps no flow records (no --flow-records-rate)" in capsys.readouterr().err


def test_verify_reads_each_nodes_records_and_says_which_could_not_be_read() -> None:
    outputs = {"n1": [json.dumps(record())], "n2": [json.dumps(record(node="n2"))] * 2}

    def run(command: list[str]) -> Iterator[str]:
        if command[0] == "n3":
            raise flows.FlowsError("no such socket")
        yield from outputs[command[0]]

    found, unread = flows.read_nodes({node: [node] for node in ("n1", "n2", "n3")}, run)
    assert sorted(r["node"] for r in found) == ["n1", "n2", "n2"]
    assert unread == {"n3": "no such socket"}


def test_a_nodes_reader_run_at_once_says_why_it_failed() -> None:
    def failing(*said: str) -> list[str]:
        return [sys.executable, "-c", f"import sys; sys.exit({chr(10).join(said)!r})"]

    lines = list(flows.run_captured([sys.executable, "-c", "print('{}'); print('{}')"]))
    assert lines == ["{}", "{}"]
    # what the reader in the knit pod said, before kubectl exec's own last line
    said = failing("kubectl knit flows: no socket", "command terminated with exit code 2")
    with pytest.raises(flows.FlowsError, match=r"^no socket$"):
        list(flows.run_captured(said))
    with pytest.raises(flows.FlowsError, match=r"^not found$"):
        list(flows.run_captured(failing("Error from server", "not found")))


def test_without_kubectl_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KUBECTL", raising=False)
    monkeypatch.setenv("PATH", "")
    with pytest.raises(flows.FlowsError, match="kubectl"):
        flows.kubectl()


def test_a_reader_that_goes_away_ends_flows_quietly(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def closed(*_: object, **__: object) -> int:
        raise BrokenPipeError

    monkeypatch.setattr(cli, "flows_main", closed)
    pointed: list[int] = []
    monkeypatch.setattr(os, "dup2", lambda _, fd: pointed.append(fd))
    with open(os.devnull, "w") as stdout:
        monkeypatch.setattr(sys, "stdout", stdout)
        assert cli.main(["flows", "--local"]) == 1
        assert pointed == [stdout.fileno()]
    assert capsys.readouterr().err == ""


def test_the_knit_pod_of_a_node_is_its_running_one_not_one_going_away(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def knit(name: str, node: str, phase: str = "Running", leaving: bool = False) -> V1Pod:
        gone = datetime(2026, 1, 2, tzinfo=UTC) if leaving else None
        return V1Pod(
            metadata=V1ObjectMeta(name=name, deletion_timestamp=gone),
            spec=V1PodSpec(node_name=node, containers=[]),
            status=V1PodStatus(phase=phase),
        )

    listed = V1PodList(items=[
        knit("knit-new", "n1"), knit("knit-old", "n1", leaving=True),
        knit("knit-pending", "n2", "Pending"), knit("knit-c", "n3"),
    ])  # fmt: skip

    class Core:
        def __init__(self, _: object) -> None:
            pass

        def list_namespaced_pod(self, namespace: str, label_selector: str) -> V1PodList:
            assert (namespace, label_selector) == (flows.KNIT_NAMESPACE, flows.KNIT_SELECTOR)
            return listed

    monkeypatch.setattr(cli.client, "CoreV1Api", Core)
    assert cli.knit_pods(None, None) == {"n1": "knit-new", "n3": "knit-c"}  # type: ignore[arg-type]
    assert cli.knit_pods(None, "n3") == {"n3": "knit-c"}  # type: ignore[arg-type]
