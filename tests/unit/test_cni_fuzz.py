"""Generated network configs and stdin given to the plugin's whole call path: every answer is
the spec's error JSON with a spec or documented plugin code, never 199 (which is kept for
genuine bugs). The calls are ADDs naming a namespace that does not exist, so a config that
passes every check stops at the namespace (code 3) before anything touches the kernel.

KNIT_FUZZ_EXAMPLES sets how many configs a run tries (CI: the default; `make fuzz`: many).
"""

from __future__ import annotations

import json
import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cni import plugin
from cni.errors import Code
from tests.support.cni_strategies import IPAM_FIELDS, RANGE, TOP_FIELDS, VALUES

EXAMPLES = int(os.environ.get("KNIT_FUZZ_EXAMPLES", "300"))
ENV = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "fuzz", "CNI_NETNS": "/nonexistent/netns",
       "CNI_IFNAME": "eth0", "CNI_PATH": "/nonexistent"}  # fmt: skip
ANSWERED = {int(code) for code in Code} - {Code.UNEXPECTED}
BASE: dict[str, Any] = {
    "cniVersion": "1.1.0",
    "name": "fuzz",
    "type": "knit",
    "ipam": {"type": "host-local", "subnet": "10.9.0.0/24", "dataDir": "/nonexistent/ipam"},
}


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    raw = json.loads(json.dumps(BASE))
    raw.update(draw(st.dictionaries(st.sampled_from(TOP_FIELDS), VALUES, max_size=3)))
    if isinstance(raw.get("ipam"), dict):
        raw["ipam"].update(draw(st.dictionaries(st.sampled_from(IPAM_FIELDS), VALUES, max_size=3)))
        if draw(st.booleans()):
            raw["ipam"]["ranges"] = draw(st.lists(st.lists(RANGE, max_size=2), max_size=2))
    return raw


def answer(stdin: bytes) -> dict[str, Any]:
    code, output = plugin.execute(ENV, stdin)
    assert code == 1, output
    answered = json.loads(output)
    assert set(answered) <= {"cniVersion", "code", "msg", "details"}
    assert answered["code"] in ANSWERED, answered
    assert answered["msg"]
    return answered


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_any_config_gets_an_answer_with_a_code_other_than_199(raw):
    answered = answer(json.dumps(raw).encode())
    if answered["code"] == Code.UNKNOWN_CONTAINER:
        assert "/nonexistent/netns" in answered["msg"]  # every check passed


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_any_stdin_gets_an_answer_with_a_code_other_than_199(stdin):
    answer(stdin)
