"""List+watch of one resource through the daemon's API client (kubeapi.py).

Objects stay the API server's JSON (dicts): the generated models cost far more time and memory
than the proxy needs at 10,000 services. A list (in pages) replaces the whole set; the watch
then streams changes from its resourceVersion, with bookmarks; 410 Gone leads to a relist at once,
a broken connection or an unreachable API server to a relist after a backoff, and the rules
already in the kernel stay as they are meanwhile.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from proxyd import gc_pause
from proxyd.kubeapi import Api, Response

log = logging.getLogger(__name__)

PAGE_SIZE = 500
MAX_BACKOFF = 30.0
IGNORED_LABELS_SELECTOR = (
    "!service.kubernetes.io/service-proxy-name,!service.kubernetes.io/headless"
)

Obj = dict[str, Any]


def _whole(obj: Obj) -> Obj:
    return obj


@dataclass(frozen=True)
class Resource:
    kind: str
    path: str
    label_selector: str = ""
    field_selector: str = ""
    trim: Callable[[Obj], Obj] = _whole
    """What of each listed object to keep, applied as each page arrives: otherwise a list of
    pods holds every pod whole, managedFields and all, at once
    (docs/benchmarks.md#networkpolicy-make-bench-policy)."""
    optional: bool = False
    """A resource the API server may not serve (404): a custom resource not installed, or one
    too new for it. Until a first list it counts as empty; once listed, a 404 keeps what was
    listed and watched. It is looked for again every MAX_BACKOFF seconds."""


def services() -> Resource:
    return Resource("Service", "/api/v1/services", IGNORED_LABELS_SELECTOR)


def endpoint_slices() -> Resource:
    return Resource(
        "EndpointSlice", "/apis/discovery.k8s.io/v1/endpointslices", IGNORED_LABELS_SELECTOR
    )


def nodes() -> Resource:
    return Resource("Node", "/api/v1/nodes")


def service_cidrs() -> Resource:
    """Optional: API servers before Kubernetes 1.33 do not serve networking.k8s.io/v1."""
    return Resource("ServiceCIDR", "/apis/networking.k8s.io/v1/servicecidrs", optional=True)


def pods(trim: Callable[[Obj], Obj] = _whole) -> Resource:
    return Resource("Pod", "/api/v1/pods", trim=trim)


def namespaces() -> Resource:
    return Resource("Namespace", "/api/v1/namespaces")


def network_policies() -> Resource:
    return Resource("NetworkPolicy", "/apis/networking.k8s.io/v1/networkpolicies")


def cluster_network_policies() -> Resource:
    return Resource(
        "ClusterNetworkPolicy",
        "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies",
        optional=True,
    )


class Gone(Exception):
    """The watch's resourceVersion is too old: relist."""


class NotServed(Exception):
    """The API server does not serve the resource (404)."""


class Reflector:
    """Lists, then watches, one resource. `on_replace` gets each fresh list and may empty
    it: the reflector reads nothing of it afterwards."""

    def __init__(
        self,
        api: Api,
        resource: Resource,
        on_replace: Callable[[list[Obj]], None],
        on_event: Callable[[str, Obj], None],
        stop: threading.Event,
    ) -> None:
        self._api = api
        self._resource = resource
        self._on_replace = on_replace
        self._on_event = on_event
        self._stop = stop
        self._listed = False
        """Whether the API server has answered a list."""

    def _get(self, query: list[tuple[str, str]], timeout: tuple[float, float]) -> Response:
        response = self._api.get(self._resource.path, query, timeout)
        if response.status == 200:
            return response
        body = response.read()
        if response.status == 404 and self._resource.optional:
            raise NotServed(self._resource.path)
        raise ConnectionError(
            f"{self._resource.kind} request: HTTP {response.status} {body[:200]!r}"
        )

    def _selectors(self) -> list[tuple[str, str]]:
        query: list[tuple[str, str]] = []
        if self._resource.label_selector:
            query.append(("labelSelector", self._resource.label_selector))
        if self._resource.field_selector:
            query.append(("fieldSelector", self._resource.field_selector))
        return query

    def list(self) -> tuple[list[Obj], str]:
        items: list[Obj] = []
        token = ""
        while True:
            query = [*self._selectors(), ("limit", str(PAGE_SIZE))]
            if token:
                query.append(("continue", token))
            page = json.loads(self._get(query, (10, 60)).read())
            items.extend(self._resource.trim(item) for item in page.get("items") or [])
            token = (page.get("metadata") or {}).get("continue") or ""
            if not token:
                return items, page["metadata"]["resourceVersion"]

    def _events(self, resource_version: str) -> Iterator[tuple[str, Obj]]:
        query = [
            *self._selectors(),
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("resourceVersion", resource_version),
            ("timeoutSeconds", str(random.randint(300, 600))),
        ]
        stream = self._get(query, (10, 660))
        try:
            for line in stream:
                if self._stop.is_set():
                    return
                if line.strip():
                    event = json.loads(line)
                    yield event["type"], event["object"]
        finally:
            stream.close()

    def _watch(self, resource_version: str) -> None:
        while not self._stop.is_set():
            for kind, obj in self._events(resource_version):
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Gone(obj.get("message", ""))
                    raise ConnectionError(f"watch error: {obj.get('message', obj)}")
                resource_version = obj["metadata"]["resourceVersion"]
                if kind != "BOOKMARK":
                    self._on_event(kind, obj)

    def _relist(self) -> str:
        """List, hand the objects over, and return the list's resourceVersion. The list is
        not held past the hand-over: kept in run()'s frame while it watched, every listed
        object's JSON stayed alive for good (docs/benchmarks.md#beside-kube-proxy)."""
        with gc_pause.paused():
            items, resource_version = self.list()
            self._on_replace(items)
        self._listed = True
        return resource_version

    def _not_served(self) -> None:
        kind = self._resource.kind
        if not self._listed:
            log.info("%s is not served; looking again in %.0fs", kind, MAX_BACKOFF)
            # The first sync waits for a first list of every resource: nothing served yet is
            # an empty list.
            self._on_replace([])
            return
        # A 404 does not say the objects are gone: deleting a CRD deletes its objects first,
        # each seen by the watch. Emptying them here would drop every ClusterNetworkPolicy,
        # and let through what they deny, on a CRD briefly missing or an API server
        # misrouting one request.
        log.warning(
            "%s is no longer served; keeping the objects last listed and watched, "
            "looking again in %.0fs",
            kind,
            MAX_BACKOFF,
        )

    def run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                resource_version = self._relist()
                backoff = 0.5
                self._watch(resource_version)
            except Gone as err:
                log.info("%s watch expired (%s); relisting", self._resource.kind, err)
            except NotServed:
                self._not_served()
                self._stop.wait(MAX_BACKOFF)
            except Exception as err:
                log.warning(
                    "%s list/watch failed (%s); retrying in %.1fs",
                    self._resource.kind,
                    err,
                    backoff,
                )
                self._stop.wait(backoff)
                backoff = min(MAX_BACKOFF, backoff * 2)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run, name=f"watch-{self._resource.kind}", daemon=True)
        thread.start()
        return thread
