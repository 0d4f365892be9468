"""The daemon's API client (proxyd.kubeapi) without an API server: what it reads of
kubeconfigs, what it refuses, and its requests against a scripted server on loopback (kept
connections, a 401 answered by a fresh credential, an exec plugin's token and its expiry).
Against the real API server: tests/integration/test_kubeapi.py."""

from __future__ import annotations

import base64
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from proxyd import kubeapi


def write(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(json.dumps(config))
    return path


def kubeconfig(server: str, user: dict[str, Any], **cluster: Any) -> dict[str, Any]:
    return {
        "clusters": [{"name": "c", "cluster": {"server": server, **cluster}}],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }


class Recorder(BaseHTTPRequestHandler):
    """Answers every GET with its Authorization header; 401 to the tokens in `refused`."""

    protocol_version = "HTTP/1.1"
    seen: ClassVar[list[tuple[str, str, int]]] = []
    refused: ClassVar[set[str]] = set()

    def do_GET(self) -> None:
        authorization = self.headers.get("Authorization", "")
        port = self.client_address[1]
        type(self).seen.append((self.path, authorization, port))
        status = 401 if authorization.removeprefix("Bearer ") in self.refused else 200
        body = json.dumps({"authorization": authorization}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    Recorder.seen, Recorder.refused = [], set()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_a_token_is_sent_and_the_connection_kept_between_requests(
    server: str, tmp_path: Path
) -> None:
    api = kubeapi.from_kubeconfig([write(tmp_path / "c", kubeconfig(server, {"token": "t0"}))])
    first = api.get("/api/v1/nodes", [("limit", "1"), ("labelSelector", "a!=b")])
    assert first.status == 200 and json.loads(first.read()) == {"authorization": "Bearer t0"}
    api.get("/api/v1/pods").read()
    (path, _, port), (_, _, again) = Recorder.seen
    assert path == "/api/v1/nodes?limit=1&labelSelector=a%21%3Db"
    assert port == again, "the second request reused the first's connection"


def test_a_token_file_is_read_again_after_a_401(server: str, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("old\n")
    Recorder.refused = {"old"}
    api = kubeapi.from_kubeconfig(
        [write(tmp_path / "c", kubeconfig(server, {"tokenFile": "token"}))]
    )
    assert api.get("/version").status == 401, "still the refused token: nothing better"
    token.write_text("rotated\n")
    answer = api.get("/version")
    assert answer.status == 200 and json.loads(answer.read())["authorization"] == "Bearer rotated"


EXEC_PLUGIN = """#!/bin/sh
echo run >> "$(dirname "$0")/runs"
echo "$KUBERNETES_EXEC_INFO" > "$(dirname "$0")/info"
printf '{"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential",
  "status": {"token": "%s-%s", "expirationTimestamp": "%s"}}' \
  "$PREFIX" "$(wc -l < "$(dirname "$0")/runs" | tr -d ' ')" "$EXPIRES"
"""


def exec_config(tmp_path: Path, server: str, expires: str) -> Path:
    plugin = tmp_path / "bin" / "plugin"
    plugin.parent.mkdir()
    plugin.write_text(EXEC_PLUGIN)
    plugin.chmod(0o755)
    user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": "./bin/plugin",  # relative to the kubeconfig's folder, as in client-go
            "env": [{"name": "PREFIX", "value": "tok"}, {"name": "EXPIRES", "value": expires}],
            "provideClusterInfo": True,
            "interactiveMode": "Never",
        }
    }
    return write(tmp_path / "c", kubeconfig(server, user))


def test_an_exec_plugin_token_is_kept_until_a_401(server: str, tmp_path: Path) -> None:
    api = kubeapi.from_kubeconfig([exec_config(tmp_path, server, "2999-01-01T00:00:00Z")])
    for _ in range(3):
        api.get("/version").read()
    assert [auth for _, auth, _ in Recorder.seen] == ["Bearer tok-1"] * 3
    info = json.loads((tmp_path / "bin" / "info").read_text())
    assert info["kind"] == "ExecCredential" and info["spec"]["cluster"]["server"] == server
    Recorder.refused = {"tok-1"}
    assert json.loads(api.get("/version").read())["authorization"] == "Bearer tok-2"


def test_an_expired_exec_token_is_asked_for_again(server: str, tmp_path: Path) -> None:
    api = kubeapi.from_kubeconfig([exec_config(tmp_path, server, "2000-01-01T00:00:00Z")])
    api.get("/version").read()
    api.get("/version").read()
    assert [auth for _, auth, _ in Recorder.seen] == ["Bearer tok-1", "Bearer tok-2"]


def test_a_failing_exec_plugin_is_a_config_error_naming_it(server: str, tmp_path: Path) -> None:
    user = {"exec": {"command": "false", "apiVersion": "client.authentication.k8s.io/v1"}}
    api = kubeapi.from_kubeconfig([write(tmp_path / "c", kubeconfig(server, user))])
    with pytest.raises(kubeapi.ConfigError, match="exec credential plugin false exited with 1"):
        api.get("/version")


def test_kubeconfigs_merge_as_kubectl_merges_them(tmp_path: Path) -> None:
    """The first file to name an entry or set current-context wins; each file's relative
    paths are its own folder's."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = write(tmp_path / "a" / "config", {
        "current-context": "second",
        "users": [{"name": "u", "user": {"tokenFile": "token"}}],
    })  # fmt: skip
    second = write(tmp_path / "b" / "config", {
        **kubeconfig("http://127.0.0.1:1", {"token": "loses"}),
        "contexts": [{"name": "second", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    })  # fmt: skip
    api = kubeapi.from_kubeconfig([first, second])
    assert api.credential == kubeapi.TokenFile(tmp_path / "a" / "token")
    assert (api.endpoint.host, api.endpoint.port) == ("127.0.0.1", 1)


@pytest.mark.parametrize(
    ("user", "cluster", "error"),
    [
        ({"auth-provider": {"name": "oidc"}}, {}, "user setting auth-provider is not supported"),
        ({"username": "a", "password": "b"}, {}, "user setting username is not supported"),
        ({"token": "t", "as": "system:admin"}, {}, "user setting as is not supported"),
        ({"token": "t", "as-groups": ["system:masters"]}, {}, "user setting as-groups is not"),
        ({"token": "t"}, {"certificate-authority": "/nonexistent/ca.crt"}, "No such file"),
        ({"token": "t"}, {"proxy-url": "http://proxy:3128"}, "proxy-url is not supported"),
        ({"client-certificate-data": "not base64!"}, {}, "is not base64 of PEM text"),
        ({"client-key": "/nonexistent/key"}, {}, "client-key /nonexistent/key"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(
    tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any], error: str
) -> None:
    config = write(tmp_path / "c", kubeconfig("https://127.0.0.1:6443", user, **cluster))
    with pytest.raises(kubeapi.ConfigError, match=error):
        kubeapi.from_kubeconfig([config])


def test_a_client_certificate_needs_its_key(tmp_path: Path) -> None:
    pem = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n").decode()
    config = kubeconfig("https://127.0.0.1:6443", {"client-certificate-data": pem})
    with pytest.raises(kubeapi.ConfigError, match="needs both its certificate and its key"):
        kubeapi.from_kubeconfig([write(tmp_path / "c", config)])


@pytest.mark.parametrize(
    ("config", "error"),
    [
        ({"contexts": []}, "no current-context"),
        ({"current-context": "gone"}, "no context named 'gone'"),
        ({**kubeconfig("ftp://h", {}), "current-context": "x"}, "not an http"),
        ({**kubeconfig("https://h:1/prefix", {})}, "a path prefix is not supported"),
        ({"users": "not a list of entries"}, "a malformed user entry"),
    ],
)
def test_a_kubeconfig_without_a_usable_context_is_refused(
    tmp_path: Path, config: dict[str, Any], error: str
) -> None:
    with pytest.raises(kubeapi.ConfigError, match=error):
        kubeapi.from_kubeconfig([write(tmp_path / "c", config)])


def test_in_cluster_needs_the_kubelets_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(kubeapi.ConfigError, match="not in a cluster"):
        kubeapi.in_cluster(tmp_path)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    with pytest.raises(kubeapi.ConfigError, match=r"ca\.crt"):
        kubeapi.in_cluster(tmp_path)


def openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)


def test_client_certificate_data_loads_folded_and_an_encrypted_key_is_refused(
    tmp_path: Path,
) -> None:
    openssl(tmp_path, "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-out", "plain.key")  # fmt: skip
    openssl(tmp_path, "req", "-new", "-x509", "-key", "plain.key", "-subj", "/CN=knit",
            "-days", "1", "-out", "client.crt")  # fmt: skip
    openssl(tmp_path, "pkey", "-in", "plain.key", "-aes256", "-passout", "pass:secret",
            "-out", "locked.key")  # fmt: skip

    def folded(name: str) -> str:
        data = base64.b64encode((tmp_path / name).read_bytes()).decode()
        return "\n".join(data[i : i + 60] for i in range(0, len(data), 60))

    def user(key: str) -> dict[str, Any]:
        return {"client-certificate-data": folded("client.crt"), "client-key-data": folded(key)}

    server = "https://127.0.0.1:6443"
    api = kubeapi.from_kubeconfig([write(tmp_path / "c", kubeconfig(server, user("plain.key")))])
    assert api.endpoint.tls is not None
    locked = write(tmp_path / "c", kubeconfig(server, user("locked.key")))
    with pytest.raises(kubeapi.ConfigError, match="the client key is encrypted"):
        kubeapi.from_kubeconfig([locked])
