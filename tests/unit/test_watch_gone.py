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
from kubernetes.client import ApiClient, Configuration

from deploy.lab.process import eventually
from proxyd import watch
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
    config = Configuration()
    config.host = api_server
    replaced: list[list[Obj]] = []
    events: list[tuple[str, str]] = []
    stop = threading.Event()
    reflector = Reflector(
        ApiClient(config),
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
