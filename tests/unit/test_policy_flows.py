"""Flow records: the packet a pod chain logs, traced through the rendered rules over random
clusters, names the rule explain names; records resolved, kept in the ring, served on the
daemon's socket only to root, and counted."""

from __future__ import annotations

import dataclasses
import random
import socket
import threading
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest

from proxyd.metrics import Metrics
from proxyd.policy import flow_server
from proxyd.policy.compile import Cluster, FamilyPolicy, compile_family
from proxyd.policy.decided import decided_by
from proxyd.policy.flowlog import ADDRESSES_KEPT
from proxyd.policy.flows import QUARANTINED, UNKNOWN, PodIndex, Ring, decided, resolve
from proxyd.policy.model import EGRESS, INGRESS, NetworkPolicy, Pod, parse_policy
from proxyd.policy.quarantine import quarantined
from proxyd.policy.recorder import Recorder
from proxyd.policy.render import Renderer
from proxyd.policy.verdict import Connection, Judge
from tests.support.logged_packets import EVERY_VERDICT, PREFIX, logged
from tests.support.nft_fake import applied
from tests.support.nft_trace import FORWARDED, Packet, trace
from tests.support.random_policies import NAMESPACES, from_namespace, random_objects

WEB, OTHER, CLIENT, OUTSIDE = "10.0.0.1", "10.0.0.2", "10.0.1.1", "192.0.2.7"
PODS = [
    Pod(namespace, name, {"app": name}, node, (address,), (int(ip_address(address)),), {})
    for namespace, name, node, address in (
        ("x", "web", "n1", WEB), ("x", "other", "n1", OTHER), ("y", "client", "n2", CLIENT),
    )
]  # fmt: skip


def policy(namespace: str, spec: dict[str, Any]) -> NetworkPolicy:
    return parse_policy({"metadata": {"namespace": namespace, "name": "p"}, "spec": spec})


@pytest.mark.parametrize("seed", range(25))
def test_each_logged_packet_names_the_rule_explain_names(seed: int) -> None:
    pods, policies, cluster_policies = random_objects(random.Random(2000 + seed))
    cluster = Cluster.of("n1", {(p.namespace, p.name): p for p in pods}, NAMESPACES, policies)
    table = compile_family(
        dataclasses.replace(cluster, cluster_policies=cluster_policies), 4, provenance=True
    )
    judge = Judge(table)
    unlogged = applied([Renderer(4).full(table, replacing=False)])
    ruleset = applied([Renderer(4, EVERY_VERDICT).full(table, replacing=False)])
    addresses = [p.addresses[0] for p in pods] + [OUTSIDE]
    for source in addresses:
        for destination in addresses:
            for protocol, port in (("tcp", 80), ("tcp", 8080), ("udp", 80)):
                packet = Packet(source, destination, port, protocol=protocol)
                traced = trace(ruleset, packet, FORWARDED)
                assert traced.verdict == trace(unlogged, packet, FORWARDED).verdict
                (outcome,) = traced.outcomes
                prefixes = [m for rule in outcome.visited for m in PREFIX.findall(rule)]
                connection = Connection(source, destination, protocol, port)
                expected = []
                if not (source == destination and source in table.local):
                    for direction in (EGRESS, INGRESS):
                        decision = judge.decide(direction, connection)
                        if decision is None:
                            continue
                        expected.append(decided_by(decision.decided_by, table, direction))
                        if not decision.allowed:
                            break
                case = (source, destination, protocol, port, policies, cluster_policies)
                assert len(prefixes) == len(expected), case
                for text, wanted in zip(prefixes, expected, strict=True):
                    record = logged(text, source, destination, port, protocol)
                    assert decided(record, table) == wanted, case


def isolated_web() -> tuple[FamilyPolicy, Cluster]:
    spec = {
        "podSelector": {"matchLabels": {"app": "web"}},
        "ingress": [{"from": [from_namespace("y")]}],
    }
    cluster = Cluster.of(
        "n1", {(p.namespace, p.name): p for p in PODS}, NAMESPACES, (policy("x", spec),)
    )
    return compile_family(cluster, 4, provenance=True), cluster


def test_a_record_names_both_pods_its_rule_and_a_default_deny() -> None:
    table, cluster = isolated_web()
    chain = table.ingress[WEB]
    allowed = resolve(
        logged(f"{chain} 0 allow", CLIENT, WEB, 80), "n1", table, cluster.pods, PodIndex()
    )
    assert allowed.source.pod == ("y", "client") and allowed.destination.pod == ("x", "web")
    assert allowed.to_json()["decidedBy"]["name"] == "p"
    assert allowed.to_json()["decidedBy"]["rule"] == 0
    assert allowed.to_json()["verdict"] == "allow"
    denied = resolve(
        logged(f"{chain} end drop", OTHER, WEB, 80), "n1", table, cluster.pods, PodIndex()
    )
    by = denied.to_json()["decidedBy"]
    assert (denied.verdict, by["kind"], by["name"], by["rule"]) == (
        "deny",
        "NetworkPolicy",
        "p",
        None,
    )
    outside = resolve(
        logged(f"{chain} end drop", OUTSIDE, WEB, 80), "n1", table, cluster.pods, PodIndex()
    )
    assert outside.source.pod is None and outside.destination.pod == ("x", "web")


def test_the_pod_index_answers_by_the_snapshot_it_is_given() -> None:
    index = PodIndex()
    before = {(p.namespace, p.name): p for p in PODS}
    assert index.at(before, WEB) == ("x", "web")
    assert index.at(before, OUTSIDE) is None
    moved = dataclasses.replace(PODS[0], addresses=(OUTSIDE,), numbers=(int(ip_address(OUTSIDE)),))
    after = {**before, ("x", "web"): moved}
    assert index.at(after, WEB) is None
    assert index.at(after, OUTSIDE) == ("x", "web")
    for number in range(ADDRESSES_KEPT + 1):  # more than it remembers: still right
        assert index.at(after, str(ip_address("198.51.100.0") + number)) is None
    assert index.at(after, OUTSIDE) == ("x", "web")


def test_a_rule_that_no_longer_gives_the_logged_verdict_is_unknown_never_another() -> None:
    table, _ = isolated_web()
    chain = table.ingress[WEB]
    assert decided(logged(f"{chain} 0 drop", CLIENT, WEB, 80), table).kind == UNKNOWN
    assert decided(logged(f"{chain} 5 allow", CLIENT, WEB, 80), table).kind == UNKNOWN
    assert decided(logged(f"{chain} end allow", CLIENT, WEB, 80), table).kind == UNKNOWN
    assert decided(logged("ingress-GONE 0 allow", CLIENT, WEB, 80), table).kind == UNKNOWN
    assert decided(logged(f"{chain} 0 allow", CLIENT, WEB, 80), None).kind == UNKNOWN
    held = quarantined(table, [chain])
    assert decided(logged(f"{chain} end drop", CLIENT, WEB, 80), held).kind == QUARANTINED


def test_the_ring_keeps_the_last_records_for_readers_that_follow() -> None:
    ring = Ring(3)
    assert ring.after(-1) == ([], -1)
    for number in range(5):
        ring.add({"n": number})
    items, last = ring.after(-1)
    assert [i["n"] for i in items] == [2, 3, 4] and last == 4
    assert ring.after(3) == ([{"n": 4}], 4)
    assert ring.after(4) == ([], 4)
    threading.Timer(0.05, ring.add, ({"n": 5},)).start()
    assert ring.after(4, wait=5.0) == ([{"n": 5}], 5)


def test_the_socket_serves_root_and_refuses_others(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uid = [0]
    monkeypatch.setattr(flow_server, "peer", lambda _: (1, uid[0]))
    ring = Ring()
    ring.add({"n": 0})
    server = flow_server.FlowServer(str(tmp_path / "run" / "flows.sock"), ring)
    try:
        assert (tmp_path / "run").stat().st_mode & 0o777 == 0o700
        assert list(flow_server.read(server.path, follow=False)) == [{"n": 0}]
        followed = flow_server.read(server.path, follow=True)
        assert next(followed) == {"n": 0}
        ring.add({"n": 1})
        assert next(followed) == {"n": 1}
        followed.close()
        uid[0] = 1000
        with pytest.raises(PermissionError, match="only root"):
            list(flow_server.read(server.path, follow=False))
    finally:
        server.close()
    assert not (tmp_path / "run" / "flows.sock").exists()


def test_the_socket_path_is_beside_the_cni_socket() -> None:
    assert flow_server.socket_path("/var/run/x/cni.sock") == "/var/run/x/flows.sock"
    assert flow_server.socket_path("") == "/run/knit/flows.sock"


def connections(metrics: Metrics, verdict: str) -> float:
    labels = {"kind": "NetworkPolicy", "namespace": "x", "name": "p", "verdict": verdict}
    value = metrics.registry.get_sample_value("knit_network_policy_connections_total", labels)
    return value or 0.0


def test_the_recorder_keeps_counts_and_logs_denials_within_their_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    table, cluster = isolated_web()
    chain = table.ingress[WEB]
    metrics = Metrics()
    recorder = Recorder("n1", lambda _: (table, None, cluster.pods), metrics, True, denied_rate=1)
    recorder.report(logged(f"{chain} 0 allow", CLIENT, WEB, 80))
    with caplog.at_level("INFO"):
        for _ in range(3):
            recorder.report(logged(f"{chain} end drop", OTHER, WEB, 80))
    assert recorder.ring is not None
    items, _ = recorder.ring.after(-1)
    assert [item["verdict"] for item in items] == ["allow", "deny", "deny", "deny"]
    assert (connections(metrics, "allow"), connections(metrics, "deny")) == (1, 3)
    lines = [r.getMessage() for r in caplog.records if "policy denied" in r.getMessage()]
    assert lines == [f"policy denied ingress to x/web (judged by p): tcp {OTHER} -> {WEB}:80"]


def test_without_records_the_recorder_only_logs_denials() -> None:
    table, cluster = isolated_web()
    recorder = Recorder(
        "n1", lambda _: (table, None, cluster.pods), Metrics(), False, denied_rate=5
    )
    assert recorder.ring is None
    recorder.report(logged(f"{table.ingress[WEB]} end drop", OTHER, WEB, 80))


def test_a_hung_up_follower_frees_its_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flow_server, "peer", lambda _: (1, 0))
    monkeypatch.setattr(flow_server, "FOLLOW_WAIT", 0.05)
    server = flow_server.FlowServer(str(tmp_path / "flows.sock"), Ring())
    try:
        for _ in range(flow_server.READERS * 2):
            with socket.socket(socket.AF_UNIX) as client:
                client.connect(server.path)
                client.sendall(b'{"follow": true}\n')
        assert list(flow_server.read(server.path, follow=False)) == []
    finally:
        server.close()
