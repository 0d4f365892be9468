"""The lab's real cluster (kubelet and containerd on every node, knit run by its DaemonSet),
judged by real pods and by the upstream e2e suite, once per proxy mode this kernel has: iptables
and nftables (no IPVS in this kernel). The JUnit reports stay under build/e2e/MODE/."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deploy.lab import e2e
from deploy.lab.lab import PROXY_MODES, Lab
from tests.conftest import unique_name

# bringing a lab up takes a minute or two; the e2e selection tens of minutes
pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module", params=PROXY_MODES)
def lab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    lab = Lab(unique_name("knit-t"), tmp_path_factory.mktemp("lab") / "lab", request.param)
    try:
        lab.up()
        yield lab
    finally:
        lab.down()


def test_traffic_flows_between_real_pods(lab: Lab) -> None:
    checks = lab.checks()
    assert [check for check in checks if not check.passed] == []
    assert len(checks) == 7


def test_every_network_conformance_spec_passes(lab: Lab) -> None:
    outcome = e2e.run(lab.kubeconfig, e2e.REPORTS / lab.mode, e2e.SELECTIONS["conformance"])
    assert outcome.failed == []
    assert outcome.passed
