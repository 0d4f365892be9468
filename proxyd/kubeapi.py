"""The daemon's client of the Kubernetes API: GET requests over HTTP(S), with the credentials of
a kubeconfig or of the pod's service account, answered as raw bytes or a stream of lines.

knit-proxyd only lists and watches (watch.py), and the kubernetes client's package costs 32 MiB
and ~140 ms to import, most of the daemon's fixed cost at small sizes
(docs/benchmarks.md#where-knit-proxyds-fixed-cost-goes): this module imports the standard
library and yaml only. What it reads of a kubeconfig is what client-go reads for these
requests: the current context's cluster (server, certificate authority, tls-server-name,
insecure-skip-tls-verify) and user (client certificate, token, tokenFile, an exec plugin
giving a token); what it cannot honour (a proxy, an auth provider, basic auth, an exec plugin's
client certificate) is refused with a ConfigError naming it, never ignored.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import ssl
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import yaml

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_FILE_REREAD = 60.0
"""Seconds a token file's token is used before the file is read again: the kubelet rotates a
projected service account token well before it expires (client-go also re-reads each minute)."""
EXEC_EXPIRY_MARGIN = 10.0
"""Seconds before an exec plugin's token expires that it is asked for a new one."""
EXEC_TIMEOUT = 60.0
USER_AGENT = "knit-proxyd"
RECONNECT = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
"""Errors of a kept connection that a new one answers."""
UNSUPPORTED_USER_KEYS = (
    "auth-provider", "username", "password", "as", "as-uid", "as-groups", "as-user-extra",
)  # fmt: skip
"""User settings that would change who the requests are made as, and that knit cannot honour."""


class ConfigError(Exception):
    """A kubeconfig or in-cluster environment that cannot be used, and why."""


class Credential:
    """No credential of its own (a client certificate, or none): no Authorization header."""

    def header(self) -> str | None:
        return None

    def refresh(self) -> bool:
        """After a 401: whether a new credential may do better."""
        return False


@dataclass
class Token(Credential):
    token: str = field(repr=False)

    def header(self) -> str | None:
        return f"Bearer {self.token}"


@dataclass
class TokenFile(Credential):
    """A token read from a file, again every TOKEN_FILE_REREAD seconds and after a 401."""

    path: Path
    _token: str = field(default="", compare=False, repr=False)
    _read_at: float = field(default=-TOKEN_FILE_REREAD, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def header(self) -> str | None:
        with self._lock:
            if time.monotonic() - self._read_at >= TOKEN_FILE_REREAD:
                try:
                    self._token = self.path.read_text().strip()
                except OSError as err:
                    if not self._token:
                        raise ConfigError(f"token file {self.path}: {err.strerror}") from err
                self._read_at = time.monotonic()
            return f"Bearer {self._token}"

    def refresh(self) -> bool:
        with self._lock:
            self._read_at = -TOKEN_FILE_REREAD
        return True


@dataclass
class ExecPlugin(Credential):
    """A client-go credential plugin (users[].user.exec) run for a token, which is kept until
    EXEC_EXPIRY_MARGIN before its expirationTimestamp, or until a 401."""

    command: str
    args: Sequence[str] = field(repr=False)
    env: dict[str, str] = field(repr=False)
    api_version: str
    cluster: dict[str, Any] | None
    """What provideClusterInfo hands the plugin, or None."""
    _token: str = field(default="", compare=False, repr=False)
    _expires: float | None = field(default=None, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    def header(self) -> str | None:
        with self._lock:
            stale = self._expires is not None and time.time() > self._expires - EXEC_EXPIRY_MARGIN
            if not self._token or stale:
                self._token, self._expires = self._run()
            return f"Bearer {self._token}"

    def refresh(self) -> bool:
        with self._lock:
            self._token = ""
        return True

    def _run(self) -> tuple[str, float | None]:
        spec: dict[str, Any] = {"interactive": False}
        if self.cluster is not None:
            spec["cluster"] = self.cluster
        info = {"apiVersion": self.api_version, "kind": "ExecCredential", "spec": spec}
        env = {**os.environ, **self.env, "KUBERNETES_EXEC_INFO": json.dumps(info)}
        what = f"exec credential plugin {self.command}"
        try:
            done = subprocess.run(
                [self.command, *self.args],
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=EXEC_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            raise ConfigError(f"{what}: {err}") from err
        if done.returncode != 0:
            stderr = done.stderr.decode(errors="replace").strip()
            raise ConfigError(f"{what} exited with {done.returncode}: {stderr[:500]}")
        try:
            status = json.loads(done.stdout)["status"]
            token = status.get("token")
            expiry = status.get("expirationTimestamp")
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ConfigError(f"{what}: not an ExecCredential with a status") from err
        if not isinstance(token, str) or not token:
            raise ConfigError(f"{what}: no token (client certificates are not supported)")
        return token, _timestamp(expiry, what) if expiry else None


def _timestamp(text: Any, what: str) -> float:
    try:
        return datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError as err:
        raise ConfigError(f"{what}: expirationTimestamp {text!r} is not RFC 3339") from err


@dataclass(frozen=True)
class Endpoint:
    """Where the API server is and how to reach it."""

    scheme: str
    host: str
    port: int
    tls: ssl.SSLContext | None
    server_name: str | None
    """The name the server's certificate must hold, when not the host's."""

    @classmethod
    def of(cls, server: str, tls: ssl.SSLContext | None, server_name: str | None) -> Endpoint:
        url = urlsplit(server)
        if url.scheme not in ("https", "http") or not url.hostname:
            raise ConfigError(f"server {server!r} is not an http(s) URL with a host")
        if url.path.strip("/"):
            raise ConfigError(f"server {server!r}: a path prefix is not supported")
        port = url.port or (443 if url.scheme == "https" else 80)
        tls = tls if url.scheme == "https" else None
        return cls(url.scheme, url.hostname, port, tls, server_name)


class _Connection(http.client.HTTPConnection):
    """An HTTP connection, wrapped in TLS when the endpoint has a context, with the read
    timeout set apart from the connect timeout."""

    def __init__(self, endpoint: Endpoint, connect_timeout: float) -> None:
        super().__init__(endpoint.host, endpoint.port, timeout=connect_timeout)
        self.endpoint = endpoint

    def connect(self) -> None:
        super().connect()
        if self.endpoint.tls is not None:
            name = self.endpoint.server_name or self.endpoint.host
            self.sock = self.endpoint.tls.wrap_socket(self.sock, server_hostname=name)


class Response:
    """An answer whose body is read whole (read) or line by line (iteration); close() hands
    a connection read to the end back for the thread's next request."""

    def __init__(self, api: Api, connection: _Connection, answer: http.client.HTTPResponse) -> None:
        self._api = api
        self._connection = connection
        self._answer = answer
        self.status = answer.status

    def read(self) -> bytes:
        try:
            return self._answer.read()
        finally:
            self.close()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._answer)

    def close(self) -> None:
        """Keep the connection when the answer was read to its end and the server keeps it;
        close it otherwise (a watch left mid-stream)."""
        if self._answer.isclosed() and not self._answer.will_close:
            self._api.keep(self._connection)
        else:
            self._connection.close()


class Api:
    """GET requests to one API server with one credential; each thread reuses a connection
    of its own (a reflector's pages and watches go one after the other)."""

    def __init__(self, endpoint: Endpoint, credential: Credential) -> None:
        self.endpoint = endpoint
        self.credential = credential
        self._idle = threading.local()

    def keep(self, connection: _Connection) -> None:
        old = getattr(self._idle, "connection", None)
        if old is not None and old is not connection:
            old.close()
        self._idle.connection = connection

    def _connection(self, connect_timeout: float) -> tuple[_Connection, bool]:
        """The thread's kept connection (True: reused), else a new one."""
        kept: _Connection | None = getattr(self._idle, "connection", None)
        self._idle.connection = None
        if kept is not None:
            return kept, True
        return _Connection(self.endpoint, connect_timeout), False

    def get(
        self,
        path: str,
        query: Sequence[tuple[str, str]] = (),
        timeout: tuple[float, float] = (10.0, 60.0),
        accept: str = "application/json",
    ) -> Response:
        """GET path?query; timeout is (connect, each read) in seconds. A kept connection the
        server has closed meanwhile is replaced once; a 401 refreshes the credential once."""
        target = f"{path}?{urlencode(query)}" if query else path
        refreshed = False
        while True:
            headers = {"Accept": accept, "User-Agent": USER_AGENT}
            if (authorization := self.credential.header()) is not None:
                headers["Authorization"] = authorization
            connection, reused = self._connection(timeout[0])
            try:
                if connection.sock is None:
                    connection.connect()
                connection.sock.settimeout(timeout[1])
                connection.request("GET", target, headers=headers)
                answer = connection.getresponse()
            except (OSError, http.client.HTTPException) as err:
                connection.close()
                # a kept connection the server closed meanwhile; not a timeout, which a new
                # connection would only wait out again
                if reused and isinstance(err, RECONNECT):
                    continue
                raise ConnectionError(f"GET {path}: {err}") from err
            response = Response(self, connection, answer)
            if answer.status == 401 and not refreshed and self.credential.refresh():
                response.read()
                refreshed = True
                continue
            return response


def _tls(cluster: dict[str, Any], user: dict[str, Any]) -> ssl.SSLContext:
    context = ssl.create_default_context(
        cafile=cluster.get("certificate-authority") or None,
        cadata=_data(cluster, "certificate-authority-data"),
    )
    if cluster.get("insecure-skip-tls-verify"):
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    cert = _data(user, "client-certificate-data") or _read(user, "client-certificate")
    key = _data(user, "client-key-data") or _read(user, "client-key")
    if bool(cert) != bool(key):
        raise ConfigError("a client certificate needs both its certificate and its key")
    if cert and key:
        # ssl loads a certificate and key from files only: anonymous memory files, so the key
        # never lands on a disk, nor stays anywhere if the process is killed meanwhile
        with (
            _memory_file("client.crt", cert) as cert_path,
            _memory_file("client.key", key) as key_path,
        ):
            context.load_cert_chain(cert_path, key_path, password=_encrypted)
    return context


@contextmanager
def _memory_file(name: str, text: str) -> Iterator[str]:
    """A path to `text` in an anonymous memory file, closed on leaving."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    try:
        os.write(fd, text.encode())
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _encrypted() -> str:
    """ssl's question for an encrypted key's passphrase, which a kubeconfig cannot answer
    (asked on a terminal otherwise)."""
    raise ConfigError("the client key is encrypted")


def _data(section: dict[str, Any], key: str) -> str | None:
    """A base64 setting's PEM text (ssl wants str)."""
    if not (value := section.get(key)):
        return None
    try:  # line breaks inside, as a folded YAML scalar has them, are allowed (as in Go)
        return base64.b64decode("".join(str(value).split()), validate=True).decode()
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{key} is not base64 of PEM text") from err


def _read(section: dict[str, Any], key: str) -> str | None:
    if not (path := section.get(key)):
        return None
    try:
        return Path(path).read_text()
    except OSError as err:
        raise ConfigError(f"{key} {path}: {err.strerror}") from err


def _read_base64(section: dict[str, Any], key: str) -> str | None:
    text = _read(section, key)
    return base64.b64encode(text.encode()).decode() if text else None


def _extension(cluster: dict[str, Any]) -> Any:
    """The cluster's `client.authentication.k8s.io/exec` extension, handed to the plugin."""
    for entry in cluster.get("extensions") or []:
        if isinstance(entry, dict) and entry.get("name") == "client.authentication.k8s.io/exec":
            return entry.get("extension")
    return None


def _credential(user: dict[str, Any], server: str, cluster: dict[str, Any]) -> Credential:
    if refused := [key for key in UNSUPPORTED_USER_KEYS if user.get(key)]:
        raise ConfigError(f"user setting {refused[0]} is not supported")
    if token := user.get("token"):
        return Token(str(token))
    if token_file := user.get("tokenFile"):
        return TokenFile(Path(token_file))
    if (plugin := user.get("exec")) is not None:
        if not (command := str(plugin.get("command") or "")):
            raise ConfigError("exec: no command")
        info: dict[str, Any] | None = None
        if plugin.get("provideClusterInfo"):
            info = {
                "server": server,
                "insecure-skip-tls-verify": bool(cluster.get("insecure-skip-tls-verify")),
            }
            if name := cluster.get("tls-server-name"):
                info["tls-server-name"] = name
            if ca := cluster.get("certificate-authority-data") or _read_base64(
                cluster, "certificate-authority"
            ):
                info["certificate-authority-data"] = ca
            extension = _extension(cluster)
            if extension is not None:
                info["config"] = extension
        return ExecPlugin(
            command,
            [str(arg) for arg in plugin.get("args") or []],
            {str(e["name"]): str(e["value"]) for e in plugin.get("env") or []},
            str(plugin.get("apiVersion") or "client.authentication.k8s.io/v1"),
            info,
        )
    return Credential()


PATHS = {
    "cluster": ("certificate-authority",),
    "user": ("client-certificate", "client-key", "tokenFile"),
}
"""The settings that name files: relative ones are relative to the kubeconfig that holds them."""


def _absolute(kind: str, entry: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A cluster or user entry with its relative paths made absolute, as client-go does on
    loading (an exec command too, when it has a folder in it)."""
    section = dict(entry.get(kind) or {})
    for key in PATHS[kind]:
        if (value := section.get(key)) and not os.path.isabs(str(value)):
            section[key] = str(folder / str(value))
    plugin = section.get("exec")
    if isinstance(plugin, dict):
        command = str(plugin.get("command") or "")
        if os.sep in command and not os.path.isabs(command):
            section["exec"] = {**plugin, "command": str(folder / command)}
    return {**entry, kind: section}


def merged(paths: Sequence[Path]) -> dict[str, Any]:
    """Kubeconfig files merged as kubectl merges KUBECONFIG's: the first file to name a
    cluster, user or context, or to set current-context, wins."""
    config: dict[str, Any] = {"current-context": None, "clusters": {}, "users": {}, "contexts": {}}
    for path in paths:
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError(f"kubeconfig {path}: {err}") from err
        if not isinstance(loaded, dict):
            raise ConfigError(f"kubeconfig {path}: not a mapping")
        config["current-context"] = config["current-context"] or loaded.get("current-context")
        for kind in ("cluster", "user", "context"):
            for entry in loaded.get(f"{kind}s") or []:
                if not isinstance(entry, dict) or not isinstance(entry.get(kind) or {}, dict):
                    raise ConfigError(f"kubeconfig {path}: a malformed {kind} entry")
                if kind != "context":
                    entry = _absolute(kind, entry, path.parent.absolute())
                config[f"{kind}s"].setdefault(entry.get("name"), entry.get(kind) or {})
    return config


def default_kubeconfigs() -> list[Path]:
    """KUBECONFIG's files that exist, else ~/.kube/config: where kubectl looks."""
    if listed := os.environ.get("KUBECONFIG"):
        return [Path(p) for p in listed.split(os.pathsep) if p and Path(p).exists()]
    return [Path.home() / ".kube" / "config"]


def _named(config: dict[str, Any], kind: str, name: Any) -> dict[str, Any]:
    if (found := config[f"{kind}s"].get(name)) is None:
        raise ConfigError(f"no {kind} named {name!r}")
    return dict(found)


def from_kubeconfig(paths: Sequence[Path], context: str | None = None) -> Api:
    """The API server and credential of the kubeconfig's context (default: its current)."""
    config = merged(paths)
    if not (name := context or config["current-context"]):
        raise ConfigError("the kubeconfig has no current-context")
    chosen = _named(config, "context", name)
    cluster = _named(config, "cluster", chosen.get("cluster"))
    user = _named(config, "user", chosen["user"]) if chosen.get("user") else {}
    if cluster.get("proxy-url"):
        raise ConfigError("cluster setting proxy-url is not supported")
    server = str(cluster.get("server") or "")
    try:
        tls = _tls(cluster, user) if urlsplit(server).scheme == "https" else None
        endpoint = Endpoint.of(server, tls, cluster.get("tls-server-name"))
        return Api(endpoint, _credential(user, server, cluster))
    except (OSError, ValueError, KeyError, TypeError) as err:  # ssl.SSLError is an OSError
        raise ConfigError(f"the kubeconfig's context {name!r}: {err}") from err


def in_cluster(account: Path = SERVICE_ACCOUNT) -> Api:
    """The pod's service account, for the API server the kubelet's environment names."""
    host = os.environ.get("KUBERNETES_SERVICE_HOST")
    port = os.environ.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        raise ConfigError("not in a cluster: KUBERNETES_SERVICE_HOST/PORT are not set")
    try:
        tls = ssl.create_default_context(cafile=str(account / "ca.crt"))
    except OSError as err:
        raise ConfigError(f"{account / 'ca.crt'}: {err.strerror or err}") from err
    server = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
    try:
        return Api(Endpoint.of(server, tls, None), TokenFile(account / "token"))
    except ValueError as err:  # a port that is no number
        raise ConfigError(f"KUBERNETES_SERVICE_HOST/PORT: {err}") from err
