"""The plugin driven by libcni (what containerd and CRI-O embed), chained with the reference
portmap plugin, and a hostPort carrying real traffic."""

from __future__ import annotations

import json
import subprocess

import pytest

from deploy.lab.paths import CNIDRIVER, PLUGIN_DIR, REFERENCE_PLUGINS
from tests.support.cni_env import NETWORK, UPLINK_NODE, UPLINK_OUTSIDE, bridge_conf

CONTAINERD_ARGS = (
    "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name};"
    "K8S_POD_INFRA_CONTAINER_ID={name};K8S_POD_UID=uid-{name}"
)


@pytest.fixture
def runtime(node, tmp_path):
    if not CNIDRIVER.exists():
        pytest.fail(f"{CNIDRIVER} is missing: run `make go-tools`")
    plugin = {
        k: v
        for k, v in bridge_conf(node.data_dir, ipMasq=True).items()
        if k not in ("cniVersion", "name")
    }
    conflist = {
        "cniVersion": "1.1.0",
        "name": NETWORK,
        "plugins": [plugin, {"type": "portmap", "capabilities": {"portMappings": True}}],
    }
    path = tmp_path / "10-knit.conflist"
    path.write_text(json.dumps(conflist))
    cache = tmp_path / "cache"

    def drive(verb: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return node.ns.run(
            str(CNIDRIVER),
            verb,
            "--conflist",
            str(path),
            "--cni-path",
            f"{PLUGIN_DIR}:{REFERENCE_PLUGINS}",
            "--cache-dir",
            str(cache),
            *extra,
            check=check,
        )

    return drive


def pod_args(pod_ns, name: str, *extra: str) -> list[str]:
    return [
        "--netns",
        pod_ns.path,
        "--container-id",
        name,
        "--ifname",
        "eth0",
        "--args",
        CONTAINERD_ARGS.format(name=name),
        *extra,
    ]


def test_add_check_del_through_libcni_with_a_host_port(node, make_netns, runtime):
    outside = make_netns("outside")
    node.connect_outside(outside)
    web = make_netns("pod")
    mapping = {"portMappings": [{"hostPort": 8080, "containerPort": 80, "protocol": "tcp"}]}
    added = runtime("add", *pod_args(web, "web", "--capability-args", json.dumps(mapping)))
    result = json.loads(added.stdout)
    assert result["cniVersion"] == "1.1.0"
    assert result["ips"][0]["address"] == "10.244.1.2/24"
    assert [i["name"] for i in result["interfaces"]][::2] == ["kbr0", "eth0"]

    runtime("check", *pod_args(web, "web"))
    web.serve("0.0.0.0", 80)
    assert outside.request(UPLINK_NODE, 8080) in (UPLINK_OUTSIDE, UPLINK_NODE)
    outside.serve("0.0.0.0", 9000)
    assert web.request(UPLINK_OUTSIDE, 9000) == UPLINK_NODE, "egress is masqueraded"

    web.run("ip", "route", "del", "default")
    failed = runtime("check", *pod_args(web, "web"), check=False)
    assert failed.returncode == 1
    assert json.loads(failed.stdout)["msg"].endswith(
        "route to 0.0.0.0/0 via 10.244.1.1 is missing from eth0"
    )

    teardown = pod_args(web, "web", "--capability-args", json.dumps(mapping))
    runtime("del", *teardown)
    assert not outside.reaches(UPLINK_NODE, 8080)
    assert node.leftovers() == {}
    runtime("del", *teardown)


def test_gc_and_status_through_libcni(node, make_netns, runtime):
    pods = {name: make_netns("pod") for name in ("alive", "gone1", "gone2")}
    for name, ns in pods.items():
        runtime("add", *pod_args(ns, name))
    runtime("status")
    runtime("gc", "--valid-attachments", "alive/eth0")
    assert node.reservations() == ["10.244.1.2"]
    rules = node.knit_rules()
    assert rules and all("id=alive" in rule for rule in rules)
    runtime("del", *pod_args(pods["alive"], "alive"))
    assert node.leftovers() == {}
