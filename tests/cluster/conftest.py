"""The lab's real cluster, brought up once per proxy mode this kernel has and shared by every
module of tests/cluster (pytest runs all of one mode's tests, then the other's)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deploy.lab.lab import PROXY_MODES, Lab
from deploy.lab.netns import unique_name


@pytest.fixture(scope="session", params=PROXY_MODES)
def lab(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    lab = Lab(unique_name("knit-t"), tmp_path_factory.mktemp("lab") / "lab", request.param)
    try:
        lab.up()
        yield lab
    finally:
        lab.down()
