"""The real plugin executable under generated configs, in a node namespace where a dual-stack
pod is attached already (so the node bridge exists, shared): after every ADD the answer is the
spec's JSON with an exit status to match and a code other than 199; an ADD that failed left
nothing behind (no veth, reservation, rule or link in the pod's namespace, and the bridge's MTU
and addresses as they were), and one that succeeded is undone by DEL (but for the gateway
address and MTU it may give the shared bridge).

KNIT_FUZZ_EXAMPLES (make fuzz) sets how many configs are tried; make test tries 40.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deploy.lab.netns import Netns
from tests.support.cni_env import Node, bridge_conf
from tests.support.cni_strategies import RANGE, TOP_FIELDS, VALUES

EXAMPLES = max(1, int(os.environ.get("KNIT_FUZZ_EXAMPLES", "300")) // 8)
FUZZED_IPAM = ("subnet", "rangeStart", "rangeEnd", "gateway", "routes", "unknownOption")
"""Not dataDir (a relative one would be the test's working directory) nor type (another plugin
of CNI_PATH would run with the config)."""
FUZZED_TOP = [f for f in TOP_FIELDS if f not in ("ipam", "cniVersion")]


@st.composite
def configs(draw: st.DrawFn, data_dir: Path) -> dict[str, Any]:
    conf = bridge_conf(data_dir, dual_stack=True)
    conf["cniVersion"] = draw(st.sampled_from(["1.1.0", "1.0.0", "0.4.0", "0.3.1"]))
    conf.update(draw(st.dictionaries(st.sampled_from(FUZZED_TOP), VALUES, max_size=2)))
    conf["ipam"].update(draw(st.dictionaries(st.sampled_from(FUZZED_IPAM), VALUES, max_size=2)))
    if draw(st.booleans()):
        conf["ipam"]["ranges"] = draw(st.lists(st.lists(RANGE, min_size=1, max_size=2), max_size=2))
    return conf


def node_state(node: Node, pod: Netns) -> dict[str, Any]:
    bridge = json.loads(node.ns.run("ip", "-j", "addr", "show", "dev", "kbr0").stdout)[0]
    files = sorted(
        str(p.relative_to(node.data_dir))
        for p in node.data_dir.rglob("*")
        if p.is_file() and p.name != "lock" and not p.name.startswith("last_reserved_ip.")
    )
    pod_links = json.loads(pod.run("ip", "-j", "link", "show").stdout)
    return {
        "veths": node.veths(),
        "reservations": files,
        "rules": node.knit_rules(),
        "bridge mtu": bridge["mtu"],
        "bridge addresses": sorted(a["local"] for a in bridge["addr_info"]),
        "pod links": sorted(link["ifname"] for link in pod_links),
    }


def answered(node: Node, verb: str, conf: dict[str, Any], pod: Netns) -> dict[str, Any] | None:
    """The output of a call whose answer is well formed: a result (exit 0) or an error with a
    code other than 199 (exit 1); None for an error."""
    answer = node.call(verb, conf, container_id="fuzz", netns=pod.path)
    if answer.code == 0:
        assert answer.output is None or "code" not in answer.output, answer
        return answer.output or {}
    assert answer.code == 1 and answer.output is not None, answer
    assert answer.output["code"] != 199, answer
    return None


def test_generated_configs_leave_the_node_as_they_found_it(node: Node) -> None:
    node.add_pod(bridge_conf(node.data_dir, dual_stack=True), "resident")
    pod = node.make_netns("pod")

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(configs(node.data_dir))
    def one(conf: dict[str, Any]) -> None:
        before = node_state(node, pod)
        if answered(node, "ADD", conf, pod) is None:
            assert node_state(node, pod) == before
            return
        assert answered(node, "DEL", conf, pod) is not None, "DEL of what ADD made"
        after = node_state(node, pod)
        # a successful ADD may give the shared bridge its network's gateway address and MTU,
        # which stay for the node's other pods (as the reference bridge plugin leaves them)
        shared = ("bridge mtu", "bridge addresses")
        assert {k: v for k, v in after.items() if k not in shared} == {
            k: v for k, v in before.items() if k not in shared
        }

    one()
