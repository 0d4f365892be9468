"""Reading the e2e suite's JUnit report: the selected specs by outcome."""

from __future__ import annotations

from pathlib import Path

from deploy.lab.e2e import read_cnp_log, read_junit, table

REPORT = """<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="5" disabled="0" errors="0" failures="1" time="3">
  <testsuite name="Kubernetes e2e suite" tests="5" skipped="2" failures="1" errors="0">
    <testcase name="[SynchronizedBeforeSuite]" classname="Kubernetes e2e suite" status="passed"/>
    <testcase name="[It] [sig-network] A passes" classname="Kubernetes e2e suite" status="passed"/>
    <testcase name="[It] [sig-network] B fails" classname="Kubernetes e2e suite" status="failed">
      <failure message="boom" type="failed">boom</failure>
    </testcase>
    <testcase name="[It] [sig-storage] C not selected" classname="Kubernetes e2e suite"
      status="skipped"><skipped message="skipped"/></testcase>
    <testcase name="[It] [sig-network] D skips itself" classname="Kubernetes e2e suite"
      status="skipped"><skipped message="skipped - no IPv6 here"/></testcase>
  </testsuite>
</testsuites>
"""


def test_a_report_gives_the_selected_specs_by_outcome(tmp_path: Path) -> None:
    (tmp_path / "junit_01.xml").write_text(REPORT)
    outcome = read_junit(tmp_path / "junit_01.xml")
    assert outcome.passed == ["[It] [sig-network] A passes"]
    assert outcome.failed == ["[It] [sig-network] B fails"]
    assert outcome.skipped == 1
    assert table({"nftables": outcome}).splitlines() == [
        "mode        passed  failed  skipped",
        "nftables         1       1        1",
        "  FAILED [It] [sig-network] B fails",
    ]


def test_a_cnp_conformance_log_gives_each_test_by_outcome() -> None:
    log = """=== RUN   TestConformance
=== RUN   TestConformance/CNPAdminTierEgressTCP
=== RUN   TestConformance/CNPAdminTierEgressTCP/Should_support_an_'allow-egress'_policy
    --- PASS: TestConformance/CNPAdminTierEgressTCP/Should_support_an_'allow-egress'_policy (1.2s)
    --- PASS: TestConformance/CNPAdminTierEgressTCP (5.1s)
    --- FAIL: TestConformance/CNPBaselineTierGress (30.0s)
    --- SKIP: TestConformance/CNPAdminTierEgressNodePeers (0.0s)
--- FAIL: TestConformance (40.0s)
"""
    outcome = read_cnp_log(log)
    assert outcome.passed == ["CNPAdminTierEgressTCP"]
    assert outcome.failed == ["CNPBaselineTierGress"]
    assert outcome.skipped == 1
