"""The daemon's API client (proxyd.kubeapi) against the real API server: each way it
authenticates is who the API server says it is (a service account's Forbidden names it; a
client certificate's is the reflector tests' admin), a token file rotated under it is read
again, and the server's certificate is checked against the name asked for."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from deploy.lab.controlplane import ControlPlane
from deploy.lab.netns import unique_name
from proxyd import kubeapi


@pytest.fixture
def account_tokens(kube_api: ApiClient) -> Iterator[dict[str, str]]:
    """Two fresh service accounts in default (no roles bound): name -> a bound token."""
    core = client.CoreV1Api(kube_api)
    tokens = {}
    for _ in range(2):
        name = unique_name("kubeapi")
        core.create_namespaced_service_account(
            "default", client.V1ServiceAccount(metadata=client.V1ObjectMeta(name=name))
        )
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=600)
        )
        made = core.create_namespaced_service_account_token(name, "default", request)
        tokens[name] = made.status.token
    yield tokens
    for name in tokens:
        core.delete_namespaced_service_account(name, "default")


def identity(api: kubeapi.Api) -> str:
    """Who the API server took the request for: the user its Forbidden names."""
    answer = api.get("/api/v1/nodes")
    status: dict[str, Any] = json.loads(answer.read())
    assert answer.status == 403, status
    return status["message"].split('"')[1]


def config(control_plane: ControlPlane, user: dict[str, Any], **cluster: Any) -> dict[str, Any]:
    return {
        "clusters": [{"name": "c", "cluster": {
            "server": f"https://127.0.0.1:{control_plane.port}",
            "certificate-authority": str(control_plane.state_dir / "pki" / "ca.crt"),
            **cluster,
        }}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }  # fmt: skip


def from_config(tmp_path: Path, kubeconfig: dict[str, Any]) -> kubeapi.Api:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps(kubeconfig))
    return kubeapi.from_kubeconfig([path])


def test_a_token_and_an_exec_plugins_token_authenticate_as_their_account(
    control_plane: ControlPlane, account_tokens: dict[str, str], tmp_path: Path
) -> None:
    (name, token), _ = account_tokens.items()
    account = f"system:serviceaccount:default:{name}"
    assert identity(from_config(tmp_path, config(control_plane, {"token": token}))) == account
    plugin = tmp_path / "plugin"
    plugin.write_text(
        "#!/bin/sh\nprintf '%s' '"
        + json.dumps({"kind": "ExecCredential", "status": {"token": token}})
        + "'\n"
    )
    plugin.chmod(0o755)
    execs = {"exec": {"command": str(plugin), "apiVersion": "client.authentication.k8s.io/v1"}}
    assert identity(from_config(tmp_path, config(control_plane, execs))) == account
    refused = from_config(tmp_path, config(control_plane, {"token": token + "x"}))
    assert refused.get("/api/v1/nodes").status == 401


def test_in_cluster_the_rotated_token_file_is_read_again(
    control_plane: ControlPlane,
    account_tokens: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (first, first_token), (second, second_token) = account_tokens.items()
    shutil.copy(control_plane.state_dir / "pki" / "ca.crt", tmp_path / "ca.crt")
    (tmp_path / "token").write_text(first_token)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", str(control_plane.port))
    api = kubeapi.in_cluster(tmp_path)
    assert identity(api) == f"system:serviceaccount:default:{first}"
    (tmp_path / "token").write_text(second_token)  # as the kubelet rotates it
    monkeypatch.setattr(kubeapi, "TOKEN_FILE_REREAD", 0.0)
    assert identity(api) == f"system:serviceaccount:default:{second}"


def test_the_servers_certificate_must_hold_the_name_asked_for(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    pki = control_plane.state_dir / "pki"
    admin = {"client-certificate": str(pki / "admin.crt"), "client-key": str(pki / "admin.key")}
    named = config(control_plane, admin, **{"tls-server-name": "kubernetes.default.svc"})
    assert from_config(tmp_path, named).get("/version").status == 200
    wrong = config(control_plane, admin, **{"tls-server-name": "elsewhere.example"})
    with pytest.raises(ConnectionError, match="certificate"):
        from_config(tmp_path, wrong).get("/version")
