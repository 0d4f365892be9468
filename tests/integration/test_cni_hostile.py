"""Hostile network configs given to the real plugin: each refused with the spec's code before
it can write outside the IPAM data directory or run a program from outside CNI_PATH."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.cni_env import Node, bridge_conf


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/escaped", "a/b", "..", ".hidden", "x\0y"])
def test_a_network_name_that_is_a_path_is_refused_by_every_verb(node: Node, tmp_path, name):
    conf = bridge_conf(node.data_dir, name=name)
    pod_ns = node.make_netns("pod")
    for verb in ("ADD", "CHECK", "DEL", "STATUS"):
        answer = node.call(verb, conf, container_id="hostile", netns=pod_ns.path)
        assert answer.error_code == 7, (verb, answer)
        assert "name" in answer.output["msg"]
    # nothing was written anywhere: not in the data directory, not beside or above it
    assert files_under(tmp_path) == []
    assert not Path("/tmp/escaped").exists()
    assert node.leftovers() == {}


@pytest.mark.parametrize("plugin", ["/bin/touch", "../../../bin/touch", "sub/dir", ".."])
def test_an_ipam_type_that_is_a_path_is_refused_without_running_it(node: Node, tmp_path, plugin):
    marker = tmp_path / "ran"
    conf = bridge_conf(node.data_dir)
    conf["ipam"] = {"type": plugin, "args": [str(marker)]}
    pod_ns = node.make_netns("pod")
    answer = node.call("ADD", conf, container_id="hostile", netns=pod_ns.path)
    assert answer.error_code == 7, answer
    assert "ipam.type" in answer.output["msg"]
    assert not marker.exists()
    assert node.leftovers() == {}


@pytest.mark.parametrize(
    "change",
    [
        {"runtimeConfig": "x"},
        {"args": {"cni": {"ips": "10.244.1.9"}}},
        {"ipam": {"type": "host-local", "ranges": [{"subnet": "10.244.1.0/24"}]}},
        {"ipam": {"type": "host-local", "subnet": "10.244.1.0/24", "dataDir": 5}},
    ],
)
def test_a_field_of_the_wrong_type_is_code_7_not_a_traceback(node: Node, change):
    conf = {**bridge_conf(node.data_dir), **change}
    pod_ns = node.make_netns("pod")
    answer = node.call("ADD", conf, container_id="hostile", netns=pod_ns.path)
    assert answer.error_code == 7, answer
    assert "details" not in answer.output
    assert node.leftovers() == {}


def test_deeply_nested_json_is_a_decode_failure(node: Node):
    nested = b'{"cniVersion": "1.1.0", "name": "n", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    answer = node.call("ADD", nested, container_id="hostile", netns="/nonexistent")
    assert answer.error_code == 6, answer
    assert "nested too deeply" in answer.output["msg"]


def test_a_fifo_as_cni_netns_is_refused_at_once(node: Node, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    conf = bridge_conf(node.data_dir)
    answer = node.call("ADD", conf, container_id="hostile", netns=str(fifo))
    assert answer.error_code == 3, answer
    assert "not a network namespace" in answer.output["msg"]
    assert node.leftovers() == {}


def test_a_small_mtu_cannot_turn_ipv6_off_on_the_shared_bridge(node: Node):
    dual = bridge_conf(node.data_dir, dual_stack=True)
    node.add_pod(dual, "first")
    before = node.ns.ip("-o", "link", "show", "kbr0").split(" mtu ")[1].split()[0]
    # another network on the same bridge, IPv4 only, asking for an MTU IPv6 cannot live with
    small = bridge_conf(node.data_dir, name="other", mtu=1000)
    small["ipam"]["ranges"] = [[{"subnet": "10.244.7.0/24"}]]
    answer = node.call("ADD", small, container_id="small", netns=node.make_netns("pod").path)
    assert answer.error_code == 7, answer
    assert "IPv6" in answer.output["msg"]
    assert node.ns.ip("-o", "link", "show", "kbr0").split(" mtu ")[1].split()[0] == before
    node.add_pod(dual, "second")  # dual-stack ADDs still work on the node


def test_a_data_dir_that_is_a_file_is_an_io_failure(node: Node, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    conf = bridge_conf(a_file)
    pod_ns = node.make_netns("pod")
    for verb in ("ADD", "DEL"):
        answer = node.call(verb, conf, container_id="hostile", netns=pod_ns.path)
        assert answer.error_code == 5, (verb, answer)
        assert "dataDir" in answer.output["msg"]
    assert node.leftovers() == {}


@pytest.mark.parametrize(
    "route",
    [
        {"dst": "10.5.0.0/16", "priority": 2**70},
        {"dst": "10.5.0.0/16", "mtu": -5},
        {"dst": "10.5.0.0/16", "scope": 256},
        {"dst": "10.5.0.0/16", "table": 1.5},
        {"dst": "10.5.0.0/16", "advmss": "9"},
    ],
)
def test_a_route_number_the_kernel_cannot_hold_is_code_7(node: Node, route):
    conf = bridge_conf(node.data_dir)
    conf["ipam"]["routes"] = [route]
    answer = node.call("ADD", conf, container_id="hostile", netns=node.make_netns("pod").path)
    assert answer.error_code == 7, answer
    assert "route" in answer.output["msg"]
    assert node.leftovers() == {}
