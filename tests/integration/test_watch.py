"""The daemon's list+watch (proxyd.watch.Reflector) against the real API server: a list in
pages (continue tokens) that leaves out the Services another proxy owns, then a watch that
streams what changed; an unreachable API server is retried with a doubling backoff; a
resource the API server does not serve (a CRD not installed) lists as empty and is looked for
again."""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client import ApiClient

from deploy.lab.netns import unique_name
from deploy.lab.process import eventually
from proxyd import kubeapi, watch
from proxyd.watch import Obj, Reflector


def service(name: str, **labels: str) -> client.V1Service:
    return client.V1Service(
        metadata=client.V1ObjectMeta(name=name, labels=labels),
        spec=client.V1ServiceSpec(ports=[client.V1ServicePort(port=80)]),
    )


@pytest.fixture
def services(kube_api: ApiClient) -> Iterator[list[str]]:
    """Names of Services to make in default; whatever was made is deleted at the end."""
    made: list[str] = []
    yield made
    core = client.CoreV1Api(kube_api)
    for name in made:
        core.delete_namespaced_service(name, "default")


def test_a_paged_list_then_a_watch_of_what_changed(
    kube_api: ApiClient,
    proxy_api: kubeapi.Api,
    services: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    core = client.CoreV1Api(kube_api)
    paged = [unique_name("paged") for _ in range(5)]
    other = unique_name("other-proxy")
    for name in paged:
        core.create_namespaced_service("default", service(name))
        services.append(name)
    core.create_namespaced_service(
        "default", service(other, **{"service.kubernetes.io/service-proxy-name": "other"})
    )
    services.append(other)
    monkeypatch.setattr(watch, "PAGE_SIZE", 2)
    queries: list[list[tuple[str, str]]] = []
    real_get = Reflector._get

    def recorded_get(self: Reflector, query: list[tuple[str, Any]], timeout: Any) -> Any:
        queries.append(query)
        return real_get(self, query, timeout)

    monkeypatch.setattr(Reflector, "_get", recorded_get)
    lists: list[list[Obj]] = []
    events: list[tuple[str, str]] = []
    stop = threading.Event()
    reflector = Reflector(
        proxy_api,
        watch.services(),
        lists.append,
        lambda kind, obj: events.append((kind, obj["metadata"]["name"])),
        stop,
    )
    reflector.start()
    try:
        eventually(lambda: lists, what="the first list")
        listed = {obj["metadata"]["name"] for obj in lists[0]}
        assert set(paged) <= listed and other not in listed
        pages = [dict(query) for query in queries if "watch" not in dict(query)]
        assert len(pages) >= 3 and all(page["limit"] == "2" for page in pages)
        assert all("continue" in page for page in pages[1:])
        late = unique_name("late")
        core.create_namespaced_service("default", service(late))
        services.append(late)
        core.delete_namespaced_service(paged[0], "default")
        services.remove(paged[0])
        eventually(lambda: ("DELETED", paged[0]) in events, what="the deletion watched")
        assert ("ADDED", late) in events
        assert all(name != other for _, name in events)
        assert len(lists) == 1, "no relist while the watch held"
    finally:
        stop.set()


class Listed(dict[str, Any]):
    """A listed object that can be watched for its end (a plain dict takes no weakref)."""


def test_the_list_is_not_held_while_watching(
    kube_api: ApiClient, proxy_api: kubeapi.Api, services: list[str]
) -> None:
    core = client.CoreV1Api(kube_api)
    name = unique_name("held")
    core.create_namespaced_service("default", service(name))
    services.append(name)
    alive: list[weakref.ref[Listed]] = []

    def tracked(obj: Obj) -> Obj:
        listed = Listed(obj)
        alive.append(weakref.ref(listed))
        return listed

    names: list[str] = []
    stop = threading.Event()
    resource = dataclasses.replace(watch.services(), trim=tracked)
    reflector = Reflector(
        proxy_api,
        resource,
        lambda objs: names.extend(obj["metadata"]["name"] for obj in objs),
        lambda kind, obj: None,
        stop,
    )
    reflector.start()
    try:
        eventually(lambda: name in names, what="the first list")
        time.sleep(0.5)  # into the watch
        gc.collect()
        assert alive and all(ref() is None for ref in alive), "the list outlived its hand-over"
    finally:
        stop.set()


def test_an_unreachable_api_server_is_retried_with_a_doubling_backoff(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # discard: nothing listens on loopback there
    nowhere = kubeapi.Api(
        kubeapi.Endpoint.of("http://127.0.0.1:9", None, None), kubeapi.Credential()
    )
    stop = threading.Event()
    reflector = Reflector(nowhere, watch.nodes(), lambda items: None, lambda *event: None, stop)
    with caplog.at_level(logging.WARNING, logger="proxyd.watch"):
        thread = reflector.start()
        try:
            eventually(lambda: "retrying in 2.0s" in caplog.text, what="a third try", timeout=30)
        finally:
            stop.set()
            thread.join(5)
    waits = [
        record.getMessage().rsplit("retrying in ", 1)[1]
        for record in caplog.records
        if "list/watch failed" in record.getMessage()
    ]
    assert waits[:3] == ["0.5s", "1.0s", "2.0s"]
    assert not thread.is_alive()


def test_a_resource_the_api_server_does_not_serve_is_listed_as_empty_and_looked_for_again(
    proxy_api: kubeapi.Api, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A custom resource whose CRD is not installed (here a made-up one): 404, not a failure."""
    monkeypatch.setattr(watch, "MAX_BACKOFF", 0.2)
    gadgets = watch.Resource("Gadget", "/apis/example.knit.test/v1/gadgets", optional=True)
    lists: list[list[Obj]] = []
    stop = threading.Event()
    reflector = Reflector(proxy_api, gadgets, lists.append, lambda *event: None, stop)
    with caplog.at_level(logging.INFO, logger="proxyd.watch"):
        thread = reflector.start()
        try:
            eventually(lambda: len(lists) >= 2, what="two looks", timeout=10)
        finally:
            stop.set()
            thread.join(5)
    assert all(listed == [] for listed in lists)
    assert "Gadget is not served; looking again in 0s" in caplog.text
    assert "list/watch failed" not in caplog.text
