from __future__ import annotations

import pytest

from tests.integration.cni_env import Node


@pytest.fixture
def node(make_netns, tmp_path) -> Node:
    return Node(make_netns("node"), tmp_path / "ipam", make_netns)
