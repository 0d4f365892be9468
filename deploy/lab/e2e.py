"""Upstream suites as the judges of the lab's network: the Kubernetes e2e suite, and
network-policy-api's ClusterNetworkPolicy conformance suite.

`run` drives the pinned e2e.test with ginkgo against a kubeconfig and reads its JUnit report;
`run_cnp` runs the conformance suite's test binary and reads its verbose log.
`python -m deploy.lab.e2e` brings a lab up once per proxy mode (iptables and nftables; this
kernel has no IPVS, so that mode is not run), runs a selection, prints a table of passed,
failed and skipped specs per mode, keeps the reports under build/e2e/MODE/ and exits non-zero
on any failure.

The e2e selections are the kind workflow's (.github/workflows/kind-e2e.yaml) narrowed to
sig-network: `network` is Services, Networking, KubeProxy, Conntrack and every network
[Conformance] spec (`make e2e`); `conformance` is the network [Conformance] specs alone (what
`make test` runs); `netpol` the NetworkPolicy specs. `cnp` is the ClusterNetworkPolicy suite
(v0.2.0, built with tests/go/netpolapi/no-sctp.patch): of its 24 tests, the standard ones and
the named-port ones (an extended feature knit supports), 18 in all. Not run: the four that
probe only over SCTP (this kernel has no SCTP sockets; the patch also turns the SCTP probes
inside the other tests into logged skips), and the two of egress node peers, an experimental
peer knit does not implement.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from deploy.lab.lab import PROXY_MODES, Lab
from deploy.lab.paths import E2E, ROOT

# E2E holds e2e.test and ginkgo (make e2e-tools), and one folder of reports per proxy mode


@dataclass(frozen=True)
class Selection:
    focus: str
    skip: str


# as the kind workflow: serial, disruptive, slow and flaky specs; optional features; what the
# lab does not provide (load balancers; SCTP, which this kernel cannot open sockets of)
SKIP = (
    r"\[Serial\]|\[Disruptive\]|\[Slow\]|\[Flaky\]|\[Feature:[^\]]+\]|LoadBalancer|load.balancer"
    r"|SCTP"
)
SELECTIONS = {
    "conformance": Selection(r"\[sig-network\].*\[Conformance\]", SKIP),
    "network": Selection(
        r"\[sig-network\].*(Services|Networking|KubeProxy|Conntrack|\[Conformance\])", SKIP
    ),
    # the NetworkPolicy specs are [Feature:NetworkPolicy]; those that probe over SCTP cannot
    # run here, those that only name SCTP in a policy (and probe over TCP) can
    "netpol": Selection(
        r"\[sig-network\] Netpol",
        r"\[Serial\]|\[Disruptive\]|\[Slow\]|\[Flaky\]|\[Feature:SCTPConnectivity\]",
    ),
}
PROCS = 3


@dataclass
class Outcome:
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: int = 0


def read_junit(report: Path) -> Outcome:
    """The selected specs a ginkgo JUnit report holds, by outcome. Suite-level nodes are left
    out, and so are the specs the selection filtered out, which the report lists as skipped
    with no reason; a spec that skipped itself gives one ("skipped - ...")."""
    outcome = Outcome()
    for case in ElementTree.parse(report).iter("testcase"):
        name = case.get("name", "")
        skipped = case.find("skipped")
        if not name.startswith("[It]") or (
            skipped is not None and skipped.get("message") == "skipped"
        ):
            continue
        if skipped is not None:
            outcome.skipped += 1
        elif case.find("failure") is not None or case.find("error") is not None:
            outcome.failed.append(name)
        else:
            outcome.passed.append(name)
    return outcome


def run(
    kubeconfig: Path, report_dir: Path, selection: Selection, nodes: int, procs: int = PROCS
) -> Outcome:
    """The selected specs against the cluster of kubeconfig, which has `nodes` schedulable
    nodes; the log and JUnit in report_dir."""
    report_dir.mkdir(parents=True, exist_ok=True)
    for old in report_dir.glob("junit*.xml"):
        old.unlink()
    # e2e.test leaves its kubectl configs (test-kuberc*) in TMPDIR: a folder removed after
    with (
        (report_dir / "e2e.log").open("w") as log,
        tempfile.TemporaryDirectory(prefix="tmp-", dir=report_dir) as scratch,
    ):
        subprocess.run(
            [
                str(E2E / "ginkgo"),
                f"--procs={procs}", "--timeout=120m", "--no-color", "--silence-skips",
                f"--focus={selection.focus}", f"--skip={selection.skip}",
                str(E2E / "e2e.test"), "--",
                # without --num-nodes the specs that need two or more nodes skip themselves
                f"--kubeconfig={kubeconfig}", "--provider=skeleton", f"--num-nodes={nodes}",
                f"--report-dir={report_dir}", "--disable-log-dump=true",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
            cwd=report_dir,
            env={**os.environ, "TMPDIR": scratch},
        )  # fmt: skip
    reports = sorted(report_dir.glob("junit*.xml"))
    if not reports:
        raise RuntimeError(f"e2e wrote no JUnit report; see {report_dir / 'e2e.log'}")
    return read_junit(reports[0])


CNP_SUITE = E2E / "cnp-conformance.test"
CNP_FEATURES = ("ClusterNetworkPolicy", "ClusterNetworkPolicyNamedPorts")
CNP_GRESS_TESTS = (
    "EgressInlineCIDRPeers", "EgressTCP", "EgressUDP", "Gress", "IngressTCP", "IngressUDP",
    "EgressNamedPort", "IngressNamedPort",
)  # fmt: skip
CNP_TESTS = (
    "CNPAdminTierIntegration",
    "CNPAdminTierPriorityField",
    *(f"CNP{tier}Tier{name}" for tier in ("Admin", "Baseline") for name in CNP_GRESS_TESTS),
)
CNP_RESULT = re.compile(r"^\s*--- (PASS|FAIL|SKIP): TestConformance/(\w+) ")


def read_cnp_log(log: str) -> Outcome:
    """The outcome of each conformance test (the suite's top-level subtests) in a `-test.v`
    log."""
    outcome = Outcome()
    for line in log.splitlines():
        found = CNP_RESULT.match(line)
        if found is None:
            continue
        verdict, name = found.groups()
        if verdict == "PASS":
            outcome.passed.append(name)
        elif verdict == "FAIL":
            outcome.failed.append(name)
        else:
            outcome.skipped += 1
    return outcome


def run_cnp(kubeconfig: Path, report_dir: Path) -> Outcome:
    """The selected tests against the cluster of kubeconfig; the log in report_dir."""
    report_dir.mkdir(parents=True, exist_ok=True)
    log = report_dir / "cnp-conformance.log"
    with log.open("w") as out:
        subprocess.run(
            [
                str(CNP_SUITE), "-test.v", "-test.timeout=60m",
                f"-test.run=^TestConformance$/^({'|'.join(CNP_TESTS)})$",
                f"--supported-features={','.join(CNP_FEATURES)}",
                f"--report-output={report_dir / 'cnp-conformance-report.yaml'}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
            cwd=report_dir,
            env={**os.environ, "KUBECONFIG": str(kubeconfig)},
        )  # fmt: skip
    outcome = read_cnp_log(log.read_text())
    missing = set(CNP_TESTS) - set(outcome.passed) - set(outcome.failed)
    outcome.failed += sorted(f"{name} (no result; see {log})" for name in missing)
    return outcome


def table(outcomes: dict[str, Outcome]) -> str:
    lines = [f"{'mode':<10} {'passed':>7} {'failed':>7} {'skipped':>8}"]
    for mode, outcome in outcomes.items():
        lines.append(
            f"{mode:<10} {len(outcome.passed):>7} {len(outcome.failed):>7} {outcome.skipped:>8}"
        )
        lines += [f"  FAILED {name}" for name in outcome.failed]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--selection", choices=sorted([*SELECTIONS, "cnp"]), default="network")
    parser.add_argument("--modes", default=",".join(PROXY_MODES))
    parser.add_argument("--folder", type=Path, default=ROOT / ".lab-e2e")
    options = parser.parse_args()
    outcomes = {}
    for mode in options.modes.split(","):
        lab = Lab("knit-e2e", options.folder.resolve(), mode, e2e_images=True)
        lab.down()
        try:
            print(f"\n{mode}: bringing the lab up ...", flush=True)
            lab.up()
            print(f"{mode}: running the {options.selection} specs ...", flush=True)
            if options.selection == "cnp":
                outcomes[mode] = run_cnp(lab.kubeconfig, E2E / mode / "cnp")
            else:
                selection = SELECTIONS[options.selection]
                outcomes[mode] = run(lab.kubeconfig, E2E / mode, selection, len(lab.nodes))
        finally:
            lab.down()
    print(table(outcomes))
    sys.exit(1 if any(outcome.failed for outcome in outcomes.values()) else 0)


if __name__ == "__main__":
    main()
