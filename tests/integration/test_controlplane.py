"""The real control plane: the Python client drives it, and a node namespace reaches it."""

from __future__ import annotations

import ipaddress
import socket
import ssl
import subprocess
import sys
import tempfile
from pathlib import Path

from kubernetes import client
from kubernetes.config import new_client_from_config

from deploy.lab.controlplane import PROCESSES, SERVICE_CIDRS
from deploy.lab.netns import Netns, unique_name
from deploy.lab.paths import CONTROLPLANE_BIN
from deploy.lab.relay import NetnsForward

SERVICE_RANGES = [ipaddress.ip_network(cidr) for cidr in SERVICE_CIDRS]

PROBE = """
import sys
from kubernetes import client, config

api = config.new_client_from_config(config_file=sys.argv[1])
print(client.VersionApi(api).get_code().git_version)
print(client.CoreV1Api(api).read_namespaced_service("kubernetes", "default").spec.cluster_ip)
"""


def test_apiserver_answers_with_the_kubernetes_service_and_no_host_endpoints(kube_api):
    assert client.VersionApi(kube_api).get_code().git_version.startswith("v1.")
    service = client.CoreV1Api(kube_api).read_namespaced_service("kubernetes", "default")
    assert service.spec.cluster_ip == str(SERVICE_RANGES[0][1])
    slices = client.DiscoveryV1Api(kube_api).list_namespaced_endpoint_slice(
        "default", label_selector="kubernetes.io/service-name=kubernetes"
    )
    assert slices.items == []


def test_node_round_trip(kube_api):
    core = client.CoreV1Api(kube_api)
    name = unique_name("node")
    node = client.V1Node(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1NodeSpec(pod_cidrs=["10.244.1.0/24", "fd10:244:1::/64"]),
        status=client.V1NodeStatus(
            addresses=[client.V1NodeAddress(type="InternalIP", address="10.77.0.11")]
        ),
    )
    core.create_node(node)
    try:
        stored = core.read_node(name)
        assert stored.spec.pod_cidrs == ["10.244.1.0/24", "fd10:244:1::/64"]
        assert stored.status.addresses[0].address == "10.77.0.11"
        assert name in [item.metadata.name for item in core.list_node().items]
    finally:
        core.delete_node(name)
    assert name not in [item.metadata.name for item in core.list_node().items]


def test_dual_stack_node_port_service_and_its_endpoint_slice(kube_api):
    core, discovery = client.CoreV1Api(kube_api), client.DiscoveryV1Api(kube_api)
    name = unique_name("web")
    service = client.V1Service(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1ServiceSpec(
            type="NodePort",
            ip_family_policy="RequireDualStack",
            selector={"app": name},
            ports=[client.V1ServicePort(name="http", port=80, target_port=8080)],
        ),
    )
    endpoint_slice = client.V1EndpointSlice(
        metadata=client.V1ObjectMeta(
            name=f"{name}-v4", labels={"kubernetes.io/service-name": name}
        ),
        address_type="IPv4",
        endpoints=[
            client.V1Endpoint(
                addresses=["10.244.1.5"], conditions=client.V1EndpointConditions(ready=True)
            )
        ],
        ports=[client.DiscoveryV1EndpointPort(name="http", port=8080, protocol="TCP")],
    )
    created = core.create_namespaced_service("default", service)
    try:
        ips = [ipaddress.ip_address(ip) for ip in created.spec.cluster_ips]
        assert [ip.version for ip in ips] == [4, 6]
        assert all(ip in cidr for ip, cidr in zip(ips, SERVICE_RANGES, strict=True))
        assert 30000 <= created.spec.ports[0].node_port <= 32767

        discovery.create_namespaced_endpoint_slice("default", endpoint_slice)
        selector = f"kubernetes.io/service-name={name}"
        listed = discovery.list_namespaced_endpoint_slice("default", label_selector=selector)
        assert [item.endpoints[0].addresses for item in listed.items] == [["10.244.1.5"]]
        discovery.delete_namespaced_endpoint_slice(f"{name}-v4", "default")
        listed = discovery.list_namespaced_endpoint_slice("default", label_selector=selector)
        assert listed.items == []
    finally:
        core.delete_namespaced_service(name, "default")


def _connect_inside(node: Netns, port: int) -> socket.socket:
    with node.entered():
        return socket.create_connection(("127.0.0.1", port), timeout=5)


def test_netns_forward_reaches_the_apiserver_from_a_node_namespace(
    control_plane, make_netns, tmp_path
):
    node = make_netns("cp")
    assert not node.reaches("127.0.0.1", 6443)
    forward = NetnsForward(node.name, control_plane.port)
    try:
        kubeconfig = control_plane.write_kubeconfig(tmp_path / "node.kubeconfig", 6443)
        version, cluster_ip = node.run(sys.executable, "-c", PROBE, str(kubeconfig)).stdout.split()
        assert version.startswith("v1.")
        assert cluster_ip == str(SERVICE_RANGES[0][1])
        tls = ssl.create_default_context(cafile=control_plane.state_dir / "pki" / "ca.crt")
        # the handshake needs the apiserver: the relay of this connection is live
        held = tls.wrap_socket(_connect_inside(node, 6443), server_hostname="127.0.0.1")
    finally:
        forward.stop()
    with held:
        assert held.recv(1) == b""  # stop() closed it
    assert not node.reaches("127.0.0.1", 6443)
    forward.stop()  # a second stop does nothing
    again = NetnsForward(node.name, control_plane.port)  # the port is free again
    try:
        with tls.wrap_socket(_connect_inside(node, 6443), server_hostname="127.0.0.1"):
            pass
    finally:
        again.stop()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_cli_up_leaves_it_running_and_down_removes_it(tmp_path):
    state = tmp_path / "cp"
    cli = [sys.executable, "-m", "deploy.lab.controlplane"]
    try:
        up = subprocess.run(
            [*cli, "up", "--dir", str(state), "--bin-dir", str(CONTROLPLANE_BIN)],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        assert f"export KUBECONFIG={state / 'admin.kubeconfig'}" in up.stdout
        pids = [int((state / f"{name}.pid").read_text()) for name in PROCESSES]
        api = new_client_from_config(config_file=str(state / "admin.kubeconfig"))
        with api:
            assert client.VersionApi(api).get_code().git_version.startswith("v1.")
    finally:
        subprocess.run([*cli, "down", "--dir", str(state)], check=True, timeout=60)
    assert not state.exists()
    assert not any(_alive(pid) for pid in pids)


def test_a_kubeconfig_names_its_credential_files_so_clients_copy_nothing_to_tmp(
    control_plane, tmp_path, monkeypatch
):
    # embedded (*-data) credentials are copied by the Python client to temp files, which a
    # killed daemon leaves behind in the host's /tmp
    kubeconfig = control_plane.write_kubeconfig(tmp_path / "kubeconfig")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)
    api = new_client_from_config(str(kubeconfig))
    assert client.VersionApi(api).get_code().git_version.startswith("v1.")
    assert list((tmp_path / "tmp").iterdir()) == []
    assert "-data" not in kubeconfig.read_text()
