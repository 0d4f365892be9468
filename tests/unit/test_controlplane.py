"""The control plane's certificates and its start-up errors, without starting a real one."""

from __future__ import annotations

import ipaddress
import re
import subprocess

import pytest

from deploy.lab.controlplane import (
    SERVICE_CIDRS,
    ControlPlaneError,
    attached,
    kubeconfig_for,
    make_pki,
    start,
    write_kubeconfig,
)
from deploy.lab.relay import NetnsForward, RelayError


def _text(cert):
    return subprocess.run(
        ["openssl", "x509", "-noout", "-text", "-in", str(cert)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_certificates_chain_to_the_ca_with_the_names_clients_use(tmp_path):
    make_pki(tmp_path, SERVICE_CIDRS, ["10.77.1.2"])
    for name in ("apiserver", "admin", "kubelet-client", "controller-manager", "scheduler"):
        subprocess.run(
            ["openssl", "verify", "-CAfile", "ca.crt", f"{name}.crt"], cwd=tmp_path, check=True
        )
    serving = _text(tmp_path / "apiserver.crt")
    ips = {ipaddress.ip_address(ip) for ip in re.findall(r"IP Address:([0-9A-Fa-f:.]+)", serving)}
    assert ips == {
        ipaddress.ip_address(ip)
        for ip in ("127.0.0.1", "::1", "10.77.1.2", "10.96.0.1", "fd00:10:96::1")
    }
    assert "DNS:kubernetes.default.svc.cluster.local" in serving and "DNS:localhost" in serving
    admin = _text(tmp_path / "admin.crt")
    assert "CN = knit-admin" in admin and "O = system:masters" in admin
    assert "TLS Web Client Authentication" in admin
    assert "CN = system:kube-controller-manager" in _text(tmp_path / "controller-manager.crt")
    names = ["admin", "apiserver", "ca", "controller-manager", "kubelet-client", "scheduler"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f"{name}.{suffix}" for name in names for suffix in ("crt", "key")] + ["sa.key", "sa.pub"]
    )


def test_missing_binaries_name_the_make_target(tmp_path):
    with pytest.raises(ControlPlaneError, match="make go-tools"):
        start(tmp_path / "state", bin_dir=tmp_path)


def test_a_dying_process_is_reported_with_its_log(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, script in (("etcd", "echo etcd says no; exit 3"), ("kube-apiserver", "exit 0")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{script}\n")
        (bin_dir / name).chmod(0o755)
    with pytest.raises(ControlPlaneError, match=r"etcd exited with 3:\netcd says no"):
        start(tmp_path / "state", bin_dir=bin_dir)


def test_forward_into_a_missing_namespace_is_a_clear_error():
    with pytest.raises(RelayError, match="knit-no-such-netns"):
        NetnsForward("knit-no-such-netns", 1)


@pytest.mark.parametrize(
    ("server", "host"),
    [("https://127.0.0.1:6443", "127.0.0.1"), ("https://[fd00::1]:16443", "fd00::1")],
)
def test_an_attached_control_plane_is_found_by_its_kubeconfig(tmp_path, server, host):
    write_kubeconfig(tmp_path / "admin.kubeconfig", kubeconfig_for(tmp_path / "pki", server))
    plane = attached(tmp_path)
    assert (plane.host, plane.server, plane.processes) == (host, server, [])
    plane.stop()  # leaves it running: nothing of its own to stop


def test_an_attached_control_plane_needs_an_address_and_a_port(tmp_path):
    config = kubeconfig_for(tmp_path / "pki", "https://localhost")
    write_kubeconfig(tmp_path / "admin.kubeconfig", config)
    with pytest.raises(ControlPlaneError, match="no address and port"):
        attached(tmp_path)
