"""The VM node's fixtures. Its tests run only with KNIT_VM=1 (`make vm-test`): booting Debian's
kernel under TCG costs tens of seconds, so `make test` skips them until their cost is weighed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.lab.vm import VmNode, booted

HERE = Path(__file__).resolve().parent
BOOTS: list[str] = []
"""Each VM's boot-to-ready time, printed at the end of the run."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("KNIT_VM") == "1":
        return
    skip = pytest.mark.skip(reason="VM tests run with KNIT_VM=1 (make vm-test)")
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in BOOTS:
        terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def vm(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VmNode]:
    """A VM node booted for the module; its console log in the module's temporary folder."""
    if os.geteuid() != 0:
        pytest.skip("the VM node needs root (a tap device in a namespace)")
    with booted(tmp_path_factory.mktemp("vm")) as node:
        BOOTS.append(f"vm for {request.module.__name__}: ready in {node.boot_seconds:.1f}s")
        yield node
