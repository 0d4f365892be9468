"""The cluster state the watches feed: change tracking, relists, bad objects (pure)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from proxyd.tracker import ClusterState


def svc(name: str, port: Any = 80, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "ns", "name": name, "resourceVersion": "1"},
        "spec": {"clusterIPs": ["10.96.0.10"], "ports": [{"name": "p", "port": port}], **spec},
    }


def eps(name: str, service: str, ip: str = "10.244.1.5") -> dict[str, Any]:
    return {
        "metadata": {
            "namespace": "ns",
            "name": name,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv6" if ":" in ip else "IPv4",
        "ports": [{"name": "p", "port": 8080}],
        "endpoints": [{"addresses": [ip]}],
    }


def test_nothing_is_ready_until_the_three_lists_arrived() -> None:
    state = ClusterState("node-a")
    state.replace_services([svc("a")])
    assert not state.ready()
    state.replace_slices([])
    assert not state.ready(), "the node's addresses come with its Node"
    state.replace_node(None)  # a list without this node's: nothing more to wait for
    assert state.ready()


def test_changes_are_taken_once_and_no_op_updates_are_ignored() -> None:
    state = ClusterState("node-a")
    state.replace_services([svc("a")])
    state.replace_slices([eps("a-1", "a")])
    changes = state.take()
    assert set(changes.services) == {("ns", "a")}
    (view,) = changes.services.values()
    assert [e.ip for e in view.endpoints[view.ports[0]]] == ["10.244.1.5"]
    state.service_event("MODIFIED", svc("a"))
    assert state.take().services == {}


def test_a_relist_deletes_what_disappeared() -> None:
    state = ClusterState("node-a")
    state.replace_services([svc("a"), svc("b")])
    state.take()
    state.replace_services([svc("a")])
    changes = state.take()
    assert set(changes.services) == {("ns", "b")}
    assert changes.services[("ns", "b")].ports == []


def test_bad_objects_are_logged_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    state = ClusterState("node-a")
    with caplog.at_level(logging.WARNING):
        state.replace_services([svc("bad", port=0), svc("good")])
        state.replace_slices(
            [
                {**eps("bad-1", "good"), "ports": [{"name": "p", "port": 0}]},
                {**eps("bad-2", "good"), "addressType": "IPv6"},
                eps("good-1", "good"),
            ]
        )
    assert "skipping Service ns/bad" in caplog.text
    assert "skipping EndpointSlice ns/bad-1" in caplog.text
    assert "EndpointSlice ns/bad-2: skipping endpoint address 10.244.1.5: not IPv6" in caplog.text
    changes = state.take()
    assert ("ns", "bad") not in changes.services
    (view,) = [changes.services[("ns", "good")]]
    assert [e.ip for e in view.endpoints[view.ports[0]]] == ["10.244.1.5"]


def test_a_slice_moving_to_another_service_changes_both() -> None:
    state = ClusterState("node-a")
    state.replace_services([svc("a"), svc("b")])
    state.replace_slices([eps("s", "a")])
    state.take()
    state.slice_event("MODIFIED", eps("s", "b"))
    assert set(state.take().services) == {("ns", "a"), ("ns", "b")}


def test_change_totals_count_events_and_pending_counts_services_per_family() -> None:
    state = ClusterState("node-a")
    state.replace_services([svc("a"), svc("b")])
    state.replace_slices([eps("a-1", "a")])
    state.take()
    state.slice_event("MODIFIED", eps("a-1", "a", "10.244.1.6"))
    state.slice_event("MODIFIED", eps("a-1", "a", "10.244.1.7"))
    state.slice_event("MODIFIED", eps("a-1", "a", "10.244.1.7"))
    state.service_event("MODIFIED", svc("a", port=81))
    assert state.pending() == (1, {4: 1})
    state.slice_event("ADDED", eps("b-1", "b", "fd10::5"))
    assert state.pending() == (1, {4: 1, 6: 1})
    changes = state.take()
    assert (changes.service_changes, changes.endpoint_changes) == (1, 3)
    assert state.take().endpoint_changes == 0


def with_trigger_time(obj: dict[str, Any], at: float) -> dict[str, Any]:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    annotations = {"endpoints.kubernetes.io/last-change-trigger-time": stamp}
    return {**obj, "metadata": {**obj["metadata"], "annotations": annotations}}


def test_trigger_times_come_only_from_annotated_slices_changed_after_the_start() -> None:
    state = ClusterState("node-a")
    state.replace_services([svc("a"), svc("b"), svc("c")])
    state.replace_slices([with_trigger_time(eps("a-1", "a"), time.time() - 3600)])
    assert state.take().trigger_times == {}
    later = time.time() + 2
    state.slice_event("ADDED", eps("b-1", "b"))
    state.slice_event("ADDED", with_trigger_time(eps("c-1", "c"), later + 60))
    state.slice_event("ADDED", with_trigger_time(eps("c-2", "c", "10.244.1.6"), later))
    state.slice_event("ADDED", with_trigger_time(eps("c-3", "c", "fd10::6"), later + 30))
    changes = state.take()
    assert set(changes.services) == {("ns", "b"), ("ns", "c")}
    assert changes.trigger_times == {4: [float(int(later))], 6: [float(int(later + 30))]}
    state.slice_event("DELETED", eps("c-1", "c"))
    assert state.take().trigger_times == {}


def node(address: str) -> dict[str, Any]:
    return {
        "metadata": {"name": "node-a"},
        "status": {"addresses": [{"type": "InternalIP", "address": address}]},
    }


def test_each_change_names_the_ip_families_it_touches() -> None:
    heard: list[frozenset[int]] = []
    state = ClusterState("node-a", on_change=heard.append)
    state.replace_services([])
    state.replace_slices([])
    assert heard == [frozenset(), frozenset()], "a fresh list queues the first sync"
    heard.clear()
    state.service_event("ADDED", svc("a"))
    state.service_event("MODIFIED", svc("a", clusterIPs=["10.96.0.10", "fd00::10"]))
    state.service_event("MODIFIED", svc("a", clusterIPs=["fd00::10"]))
    state.service_event("MODIFIED", svc("a", clusterIPs=["fd00::10"]))
    state.slice_event("ADDED", eps("a-1", "a", "fd10::5"))
    state.slice_event("DELETED", eps("a-1", "a", "fd10::5"))
    state.node_event("MODIFIED", node("192.0.2.10"))
    state.node_event("MODIFIED", node("192.0.2.10"))
    assert heard == [
        frozenset({4}),
        frozenset({4, 6}),
        frozenset({4, 6}),
        frozenset({6}),
        frozenset({6}),
        frozenset({4, 6}),
    ], "an unchanged object queues nothing"
    heard.clear()
    state.replace_services([])
    assert heard == [frozenset({6})], "a relist names what it deleted"


@pytest.mark.parametrize(
    "bad",
    [
        {"metadata": {"namespace": "ns", "name": "bad"}, "spec": ["not", "a", "map"]},
        {
            "metadata": {"namespace": "ns", "name": "bad"},
            "spec": {"clusterIP": "10.96.0.9", "ports": "80"},
        },
        {"metadata": ["not", "a", "map"], "spec": {"clusterIP": "10.96.0.9", "ports": []}},
        svc("bad", port={"not": "a number"}),
    ],
)
def test_an_object_not_in_the_api_shape_is_skipped_and_the_rest_kept(
    bad: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """A list where a map belongs makes Python raise; the object is logged and skipped, and
    the list it came in still counts (a raise would fail the list, retried for ever)."""
    state = ClusterState("node-a")
    with caplog.at_level(logging.WARNING):
        state.replace_services([bad, svc("good")])
        state.replace_slices([{**eps("bad", "good"), "endpoints": "x"}, eps("e", "good")])
        state.replace_node({"metadata": {"name": "node-a"}, "status": 5})
    assert state.ready()
    views = state.take().services
    assert [str(port.name) for port in views[("ns", "good")].ports] == ["ns/good:p"]
    assert [e.ip for e in next(iter(views[("ns", "good")].endpoints.values()))] == ["10.244.1.5"]
    assert "skipping Service" in caplog.text and "skipping EndpointSlice" in caplog.text
    assert "skipping Node node-a" in caplog.text


def service_cidr(name: str, *cidrs: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"cidrs": list(cidrs)}}


def test_service_cidrs_are_every_objects_ranges_and_a_bad_object_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heard: list[frozenset[int]] = []
    state = ClusterState("node-a", on_change=heard.append)
    with caplog.at_level(logging.WARNING):
        state.replace_service_cidrs(
            [
                service_cidr("kubernetes", "10.96.0.0/16", "fd00:10:96::/112"),
                service_cidr("bad", "10.97.0.0/33"),
            ]
        )
    assert "skipping ServiceCIDR bad" in caplog.text
    assert heard == [frozenset({4, 6})]
    state.service_cidr_event("ADDED", service_cidr("extra", "10.100.0.0/24"))
    state.service_cidr_event("MODIFIED", service_cidr("extra", "10.100.0.0/24"))
    assert heard[1:] == [frozenset({4})], "an unchanged object queues nothing"
    assert state.take().service_cidrs == ("10.100.0.0/24", "10.96.0.0/16", "fd00:10:96::/112")
    state.replace_service_cidrs([service_cidr("extra", "10.100.0.0/24")])
    assert heard[-1] == frozenset({4, 6}), "a relist names what it deleted"
    assert state.take().service_cidrs == ("10.100.0.0/24",)
