"""The VM node's proofs, on Debian's kernel (IPVS and SCTP, which the development kernel
lacks): the kernel holds IPVS virtual servers and carries SCTP; the IPVS namespace tests pass
inside the VM, and so do the IPVS mode's restart and clean-up test, and (long: KNIT_VM=all)
the Service behaviour suite in the IPVS mode and the policy suite's SCTP test; and
knit-proxyd, run in the VM against the real API server, sends TCP and SCTP through a
ClusterIP and a NodePort to a pod in the VM, in each proxy mode."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from kubernetes.client import ApiClient

from deploy.lab.controlplane import ControlPlane
from deploy.lab.kube import (
    NODES,
    SERVICES,
    SLICES,
    Kube,
    endpoint,
    node_object,
    service_object,
    slice_object,
)
from deploy.lab.netns import unique_name
from deploy.lab.paths import PLUGIN_DIR, ROOT
from deploy.lab.process import eventually
from deploy.lab.vm import ADDRESS, PYTHON, VmNode
from tests.support.vm_env import (
    CONTROL_PLANE,
    add_pod,
    api_access,
    log_tail,
    make_bridge,
    request,
    serve,
    start_proxyd,
)

BACKEND = "10.244.0.10"
CLIENT = "10.244.0.20"
HTTP_NODE_PORT = 30080
SCTP_NODE_PORT = 30090
PORTS = [
    {"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP", "nodePort": HTTP_NODE_PORT},
    {
        "name": "assoc",
        "port": 90,
        "targetPort": 9090,
        "protocol": "SCTP",
        "nodePort": SCTP_NODE_PORT,
    },
]
TCG_SLOWNESS = 5
"""The namespace tests' timeouts stretched for the VM (deploy/lab/process.py's SLOWNESS):
the daemon's imports take 6.7 s under TCG, but most of a wait is the kernel's or the API's."""
VM_PLUGIN_DIR = "/run/knit-cni"
"""The plugin for the VM's interpreter (deploy/lab/plugin_dir.py)."""
SLICE_PORTS = [
    {"name": "http", "port": 8080, "protocol": "TCP"},
    {"name": "assoc", "port": 9090, "protocol": "SCTP"},
]


def test_kernel_holds_ipvs_and_carries_sctp(vm: VmNode) -> None:
    vm.run("ipvsadm", "-A", "-t", "10.0.0.1:80", "-s", "rr")
    vm.run("ipvsadm", "-a", "-t", "10.0.0.1:80", "-r", "10.0.0.2:8080", "-m")
    listing = vm.run("ipvsadm", "-Ln").stdout
    vm.run("ipvsadm", "-C")
    assert "TCP  10.0.0.1:80 rr" in listing
    assert "-> 10.0.0.2:8080" in listing
    server = serve(vm, "", 9999, "sctp")
    try:
        assert request(vm, "", "127.0.0.1", 9999, "sctp")[0] == "127.0.0.1"
        assert "sctp" in vm.run("cat", "/proc/net/protocols").stdout.lower()
    finally:
        server.stop()


def test_the_ipvs_namespace_tests_pass_in_the_vm(vm: VmNode) -> None:
    """tests/integration/test_ipvs.py as it is, run by pytest inside the VM: there its
    real-kernel tests (virtual servers carrying traffic, graceful removal with a live
    connection) run instead of skipping."""
    result = vm.run(
        PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-v", "tests/integration/test_ipvs.py",
        cwd=str(ROOT), timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:]
    for name in (
        "test_kernel_virtual_servers_carry_traffic_and_clean_up",
        "test_kernel_graceful_removal_waits_for_the_connection",
    ):
        assert f"{name} PASSED" in result.stdout


def pytest_in_vm(vm: VmNode, *arguments: str) -> str:
    """pytest run by the VM's interpreter on the checkout, verbose: against the host's API
    server (KNIT_CONTROL_PLANE, the state dir api_access wrote), its pods attached by a plugin
    directory made for the VM's interpreter (KNIT_PLUGIN_DIR); its output, once it passed."""
    vm.run(
        PYTHON, "-m", "deploy.lab.plugin_dir",
        "--output", VM_PLUGIN_DIR, "--client", str(PLUGIN_DIR / "knit"),
        cwd=str(ROOT),
    )  # fmt: skip
    result = vm.run(
        PYTHON, "-m", "pytest", "-p", "no:cacheprovider", "-v", *arguments,
        cwd=str(ROOT), timeout=1800, check=False,
        env={
            "KNIT_CONTROL_PLANE": CONTROL_PLANE,
            "KNIT_PLUGIN_DIR": VM_PLUGIN_DIR,
            "KNIT_SLOWNESS": str(TCG_SLOWNESS),
        },
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-8000:]
    return result.stdout


@pytest.mark.vm_long
@pytest.mark.timeout(1800)
def test_the_proxy_service_tests_pass_in_the_vm_in_the_ipvs_mode(vm: VmNode, world: World) -> None:
    """tests/integration/test_proxy_services.py, the module that proves each Service behaviour
    by packets in the iptables and nftables modes on the development kernel, in the IPVS
    mode."""
    printed = pytest_in_vm(vm, "-k", "ipvs", "tests/integration/test_proxy_services.py")
    assert len(re.findall(r"::(\w+)\[ipvs\] PASSED", printed)) >= 20, printed[-8000:]


@pytest.mark.timeout(900)
def test_the_ipvs_modes_restart_and_cleanup_pass_in_the_vm(vm: VmNode, world: World) -> None:
    """tests/integration/test_proxy_lifecycle.py's IPVS test: a restart's full sync keeps a
    held connection, and `--cleanup` removes every virtual server, set, chain and link."""
    printed = pytest_in_vm(vm, "-k", "ipvs", "tests/integration/test_proxy_lifecycle.py")
    assert "test_ipvs_mode_restart_keeps_connections_and_cleanup_removes_all_it_made PASSED" in (
        printed
    )


@pytest.mark.vm_long
@pytest.mark.timeout(1800)
def test_the_sctp_policy_test_passes_in_the_vm(vm: VmNode, world: World) -> None:
    """tests/integration/test_network_policy.py's SCTP test, on a two-node lab inside the VM:
    NetworkPolicy and ClusterNetworkPolicy judge SCTP associations by protocol and port."""
    printed = pytest_in_vm(vm, "-k", "sctp", "tests/integration/test_network_policy.py")
    assert "test_sctp_is_judged_by_protocol_and_port_by_both_policy_apis PASSED" in printed


@dataclass
class World:
    kube: Kube
    name: str
    kubeconfig: str
    cluster_ip: str


@pytest.fixture(scope="module")
def world(vm: VmNode, control_plane: ControlPlane, kube_api: ApiClient) -> Iterator[World]:
    """The VM as Node NAME with a backend pod (TCP 8080, SCTP 9090) and a client pod on a
    bridge, a Service of both ports backed by it, and the API server within reach."""
    kube = Kube(kube_api)
    name = unique_name("vm-node")
    make_bridge(vm)
    add_pod(vm, "backend", BACKEND)
    add_pod(vm, "client", CLIENT)
    servers = [serve(vm, "backend", 8080, "tcp"), serve(vm, "backend", 9090, "sctp")]
    try:
        kube.create(NODES, node_object(name, [ADDRESS]))
        service = kube.create(SERVICES, service_object("vm-web", PORTS, type="NodePort"))
        endpoints = [endpoint(BACKEND, name, ready=True)]
        kube.create(SLICES, slice_object("vm-web", endpoints, SLICE_PORTS))
        with api_access(vm, control_plane) as kubeconfig:
            yield World(kube, name, kubeconfig, service["spec"]["clusterIP"])
    finally:
        kube.cleanup()
        for server in servers:
            server.stop()


@pytest.fixture(scope="module", params=["ipvs", "iptables", "nftables"])
def proxy_mode(request: pytest.FixtureRequest, vm: VmNode, world: World) -> Iterator[str]:
    """knit-proxyd in the VM in the mode, until its rules for the Service are in."""
    mode: str = request.param
    daemon = start_proxyd(vm, world.kubeconfig, world.name, mode)
    log = f"/tmp/proxyd-{mode}.log"

    def programmed() -> bool:
        if daemon.poll() is not None:
            raise AssertionError(f"knit-proxyd exited:\n{log_tail(vm, log)}")
        if mode == "ipvs":
            servers = (line.split()[:2] for line in vm.run("ipvsadm", "-Ln").stdout.splitlines())
            return ["SCTP", f"{world.cluster_ip}:90"] in servers
        # the modes run before must have left nothing: the traffic below then goes through
        # this mode's rules alone
        rules = {
            "iptables": vm.run("iptables-save", "-t", "nat").stdout,
            "nftables": vm.run("nft", "list", "table", "ip", "knit", check=False).stdout,
            "ipvs": vm.run("ipvsadm", "-Ln").stdout,
        }
        return world.cluster_ip in rules.pop(mode) and not any(
            world.cluster_ip in left for left in rules.values()
        )

    try:
        try:
            eventually(programmed, timeout=180, what=f"the {mode} rules", interval=1)
        except TimeoutError as err:
            rules = vm.run("ipvsadm", "-Ln").stdout + vm.run("iptables-save").stdout
            raise AssertionError(f"{err}; the kernel has:\n{rules}") from None
        yield mode
    finally:
        daemon.stop()
        print(log_tail(vm, log))


def test_cluster_ip_carries_tcp_and_sctp(vm: VmNode, world: World, proxy_mode: str) -> None:
    ip = world.cluster_ip
    assert request(vm, "client", ip, 80) == (CLIENT, "backend")
    assert request(vm, "client", ip, 90, "sctp") == (CLIENT, "backend")
    assert request(vm, "", ip, 80)[1] == "backend"
    if proxy_mode == "ipvs":
        listing = vm.run("ipvsadm", "-Ln").stdout
        assert f"-> {BACKEND}:8080" in listing
        assert f"-> {BACKEND}:9090" in listing


def test_node_port_carries_tcp_and_sctp(vm: VmNode, world: World, proxy_mode: str) -> None:
    """From the VM's uplink namespace on the host (TCP: the host has no SCTP sockets) and from
    a pod in the VM, both masqueraded to the node, as NodePort traffic is."""
    assert vm.uplink.exchange(ADDRESS, HTTP_NODE_PORT)[1] == "backend"
    assert request(vm, "client", ADDRESS, SCTP_NODE_PORT, "sctp")[1] == "backend"
