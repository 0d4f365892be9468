"""The chaos run's pure parts: what the audit reads out of rulesets and conntrack listings
(deploy/lab/audit.py), and how the run's report places client failures in fault windows
(deploy/lab/chaos.py)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

from deploy.lab import audit
from deploy.lab.chaos import CHURN_ONLY, Client, _longest_without_answer, report
from deploy.lab.faults import Fault

IPTABLES = """
-A KNIT-SERVICES -d 10.96.0.10/32 -p udp -m comment --comment "kube-dns:dns" -m udp --dport 53 -j X
-A KNIT-SEP-1 -p tcp -m tcp -j DNAT --to-destination 10.244.1.5:8080
-A KNIT-SEP-2 -p tcp -m tcp -j DNAT --to-destination [fd10:244::5]:8080
-A KNIT-POSTROUTING -s 10.244.0.0/16 -j MASQUERADE
-A KNIT-SERVICES -d fd00:10:96::a/128 -p tcp -m tcp --dport 80 -j Y
"""
NFT = """
    map service-ips {
        elements = { 10.96.0.1 . tcp . 443 : goto service-A,
                     10.96.7.7 . sctp . 9 : goto service-B }
    }
    set hairpin { elements = { 10.244.2.3 . 10.244.2.3 } }
"""


def _addresses(*texts: str) -> set[str]:
    return {str(ipaddress.ip_address(text)) for text in texts}


def test_the_audit_reads_every_single_address_a_ruleset_names() -> None:
    found = {str(address) for address in audit.addresses_in(IPTABLES + NFT)}
    assert found == _addresses(
        "10.96.0.10", "10.244.1.5", "fd10:244::5", "fd00:10:96::a", "10.96.0.1", "10.96.7.7",
        "10.244.2.3",
    )  # fmt: skip


def test_the_audit_reads_the_service_ports_of_both_renderings() -> None:
    found = {
        (str(a), protocol, port) for a, protocol, port in audit.service_ports_in(IPTABLES + NFT)
    }
    assert found == {
        ("10.96.0.10", "udp", 53),
        ("fd00:10:96::a", "tcp", 80),
        ("10.96.0.1", "tcp", 443),
        ("10.96.7.7", "sctp", 9),
    }


def test_a_udp_entry_translated_to_an_address_no_pod_has_is_stale() -> None:
    to_deleted = (
        "udp      17 28 src=10.77.1.11 dst=10.96.5.5 sport=40000 dport=81 "
        "src=10.244.3.9 dst=10.77.1.11 sport=8081 dport=40000 [ASSURED] mark=0 use=1"
    )
    to_live = to_deleted.replace("10.244.3.9", "10.244.3.8")
    untranslated = (
        "udp      17 28 src=10.244.0.4 dst=10.244.3.9 sport=40000 dport=81 "
        "src=10.244.3.9 dst=10.244.0.4 sport=81 dport=40000 mark=0 use=1"
    )
    pods = frozenset({ipaddress.ip_address("10.244.3.8"), ipaddress.ip_address("10.244.0.4")})
    listing = "\n".join((to_deleted, to_live, untranslated))
    assert audit.stale_udp_entries(listing, pods) == [to_deleted]


def _client(tmp_path: Path, kind: str, lines: list[tuple[float, str]]) -> Client:
    log = tmp_path / f"{kind}.log"
    log.write_text("".join(f"{stamp} {outcome}\n" for stamp, outcome in lines) + "17.0 o")
    return Client("node1", kind, "target", log)


def test_failures_count_in_the_window_of_the_fault_before_them(tmp_path: Path) -> None:
    steady = _client(
        tmp_path,
        "http",
        [(1.0, "ok"), (2.0, "failed TimeoutError"), (3.0, "ok"), (11.0, "ok"),
         (12.0, "failed ConnectionRefusedError"), (13.0, "failed TimeoutError"), (14.5, "ok")],
    )  # fmt: skip
    held = _client(tmp_path, "hold", [(1.0, "ok"), (11.5, "broken"), (12.0, "ok")])
    faults = [Fault("knit-proxyd killed", "node1", 10.0, 1.0)]
    kinds = report(faults, [steady, held], began=0.0, ended=20.0)
    churn, killed = kinds[CHURN_ONLY], kinds["knit-proxyd killed"]
    assert (churn.requests, churn.failed_requests, churn.held_kept) == (3, 1, 1)
    assert (killed.injected, killed.requests, killed.failed_requests) == (1, 4, 2)
    assert (killed.held_connections, killed.held_kept) == (1, 0)
    assert killed.errors == {"ConnectionRefusedError": 1, "TimeoutError": 1}
    # the line cut short at the client's end is not read
    assert killed.longest_without_answer == 3.5


def test_a_window_with_every_attempt_answered_has_no_gap() -> None:
    lines = [(1.0, "ok"), (5.0, "ok")]
    assert _longest_without_answer(lines, 0.0, 10.0) == 0.0
    assert _longest_without_answer([*lines, (6.0, "failed")], 0.0, 10.0) == 5.0


def test_a_udp_attempt_answered_after_its_timeout_is_late_not_failed(tmp_path: Path) -> None:
    steady = _client(
        tmp_path,
        "udp",
        [(1.0, "ok"), (2.0, "failed TimeoutError/answer of attempt 7"), (2.3, "late 7 by 1.3 s"),
         (3.0, "failed TimeoutError/answer of attempt 9"), (4.0, "ok")],
    )  # fmt: skip
    window = report([], [steady], began=0.0, ended=20.0)[CHURN_ONLY]
    assert (window.requests, window.failed_requests, window.late_answers) == (4, 1, 1)
    assert window.errors == {"TimeoutError/answer": 1}
