"""The VM node's fixtures. Its tests run only with KNIT_VM set, as root: with KNIT_VM=1
(`make test`) all but those marked `vm_long`, with KNIT_VM=all (`make vm-test`) every one.
Under TCG the daemon's imports alone take 6.7 s: a namespace suite run in the VM takes
minutes."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.lab.vm import VmNode, booted

HERE = Path(__file__).resolve().parent
BOOTS: list[str] = []
"""Each VM's boot-to-ready time, printed at the end of the run."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "vm_long: a VM test that runs only with KNIT_VM=all")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    chosen = os.environ.get("KNIT_VM", "")
    skip_all = pytest.mark.skip(reason="VM tests run with KNIT_VM=1 (make test) or all")
    skip_long = pytest.mark.skip(reason="long VM tests run with KNIT_VM=all (make vm-test)")
    for item in items:
        if not item.path.is_relative_to(HERE) or chosen == "all":
            continue
        if chosen != "1":
            item.add_marker(skip_all)
        elif item.get_closest_marker("vm_long"):
            item.add_marker(skip_long)


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
