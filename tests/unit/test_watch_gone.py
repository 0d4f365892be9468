"""The reflector's answer to 410 Gone, against a scripted API server on loopback.

The real API server of the integration tests does not answer 410 to a watch on demand: its
watch cache replays a compacted history as ADDED events until its buffer has turned over. So the
answer is scripted here, in the form the API server streams it (an ERROR event holding a Status).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import parse_qs, urlparse

import pytest

from deploy.lab.process import eventually
from proxyd import kubeapi, watch
from proxyd.watch import Obj, Reflector

GONE = {
    "type": "ERROR",
    "object": {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "message": "too old resource version: 5 (12)",
        "reason": "Expired",
        "code": 410,
    },
}


def plain(server: str) -> kubeapi.Api:
    """A client of an API server on loopback without TLS or credentials."""
    return kubeapi.Api(kubeapi.Endpoint.of(server, None, None), kubeapi.Credential())


def service(name: str, resource_version: str) -> Obj:
    return {"kind": "Service", "metadata": {"name": name, "resourceVersion": resource_version}}


class ScriptedApiServer(BaseHTTPRequestHandler):
    """Lists at resourceVersion 5 then 12; the watch from 5 is Gone, the one from 12 streams
    one Service and holds."""

    watches_from: ClassVar[list[str]] = []
    lists: ClassVar[int] = 0
    release: ClassVar[threading.Event] = threading.Event()

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        query = parse_qs(urlparse(self.path).query)
        if "watch" not in query:
            type(self).lists += 1
            version = "5" if self.lists == 1 else "12"
            body = json.dumps({"metadata": {"resourceVersion": version}, "items": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        since = query["resourceVersion"][0]
        self.watches_from.append(since)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if since == "5":
            self._chunk(GONE)
        else:
            self._chunk({"type": "ADDED", "object": service("after-gone", "13")})
            self.release.wait(10)
        self.wfile.write(b"0\r\n\r\n")

    def _chunk(self, event: Obj) -> None:
        line = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.flush()

    def log_message(self, format: str, *args: object) -> None:
        return


@pytest.fixture
def api_server() -> Iterator[str]:
    ScriptedApiServer.watches_from = []
    ScriptedApiServer.lists = 0
    ScriptedApiServer.release.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    ScriptedApiServer.release.set()
    server.shutdown()
    server.server_close()


def test_a_gone_watch_is_listed_again_at_once_and_watched_from_the_new_list(
    api_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    replaced: list[list[Obj]] = []
    events: list[tuple[str, str]] = []
    stop = threading.Event()
    reflector = Reflector(
        plain(api_server),
        watch.services(),
        replaced.append,
        lambda kind, obj: events.append((kind, obj["metadata"]["name"])),
        stop,
    )
    with caplog.at_level(logging.INFO, logger="proxyd.watch"):
        thread = reflector.start()
        try:
            eventually(lambda: events, what="the watch after the relist", timeout=5)
        finally:
            stop.set()
            ScriptedApiServer.release.set()
            thread.join(5)
    assert events == [("ADDED", "after-gone")]
    assert ScriptedApiServer.watches_from == ["5", "12"]
    assert len(replaced) == 2
    assert "Service watch expired (too old resource version: 5 (12)); relisting" in caplog.text
    assert "list/watch failed" not in caplog.text, "410 is not a failure to back off from"


def cluster_policy(name: str) -> Obj:
    return {"kind": "ClusterNetworkPolicy", "metadata": {"name": name, "resourceVersion": "5"}}


class VanishingCrd(BaseHTTPRequestHandler):
    """Lists two ClusterNetworkPolicies at resourceVersion 5; the watch from there ends at once
    (the API server closing it as the CRD goes), and every request after answers 404."""

    requests: ClassVar[int] = 0

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        type(self).requests += 1
        if self.requests == 1:
            listed = [cluster_policy("deny-a"), cluster_policy("deny-b")]
            self._answer(200, {"metadata": {"resourceVersion": "5"}, "items": listed})
        elif self.requests == 2:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.write(b"0\r\n\r\n")
        else:
            self._answer(404, {"kind": "Status", "code": 404, "reason": "NotFound"})

    def _answer(self, status: int, body: Obj) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        return


def test_an_optional_resource_that_stops_being_served_keeps_the_objects_last_listed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A 404 does not say the policies are gone (deleting a CRD deletes its objects first, and a
    watch sees each go); emptying them on a 404 would let through what they deny."""
    VanishingCrd.requests = 0
    monkeypatch.setattr(watch, "MAX_BACKOFF", 0.05)
    server = ThreadingHTTPServer(("127.0.0.1", 0), VanishingCrd)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    replaced: list[list[str]] = []
    stop = threading.Event()
    reflector = Reflector(
        plain(f"http://127.0.0.1:{server.server_address[1]}"),
        watch.cluster_network_policies(),
        lambda objs: replaced.append([obj["metadata"]["name"] for obj in objs]),
        lambda kind, obj: None,
        stop,
    )
    with caplog.at_level(logging.INFO, logger="proxyd.watch"):
        thread = reflector.start()
        try:
            eventually(lambda: VanishingCrd.requests >= 5, what="several 404s", timeout=5)
        finally:
            stop.set()
            thread.join(5)
            server.shutdown()
            server.server_close()
    assert replaced == [["deny-a", "deny-b"]], "the 404s replaced nothing"
    assert "ClusterNetworkPolicy is no longer served; keeping the objects" in caplog.text
