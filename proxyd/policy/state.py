"""The NetworkPolicies, ClusterNetworkPolicies, Pods and Namespaces as the watches delivered
them, parsed.

Watch threads feed it; the policy's sync thread takes a consistent snapshot. A change that
does not alter what policies depend on (a pod's status conditions, say) queues no sync. An
object that cannot be parsed is logged with its namespace and name; a pod or namespace so
broken is left out (a pod that is in no peer set is denied by every isolating policy, so
leaving it out never widens), and a policy's problems narrow it (see model).

A pod of this node has an address before the API does: the runtime's CNI ADD, which this
daemon serves, gives it one, and kubelet writes it into the pod's status later. So the
addresses of that ADD are applied to the pod, as the API knew it without an address, until
its status has some (`runtime_addresses`): the enforcer writes the pod's isolation before the
ADD returns, and no packet reaches or leaves the pod unjudged.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from proxyd.model import Obj, key_of
from proxyd.policy.cluster_model import ClusterNetworkPolicy, parse_cluster_policy
from proxyd.policy.compile import Cluster, PodKey, PodViews
from proxyd.policy.model import (
    Namespace,
    NetworkPolicy,
    Pod,
    parse_namespace,
    parse_pod,
    parse_policy,
)
from proxyd.store import Store

log = logging.getLogger(__name__)

Parsed = TypeVar("Parsed", Pod, Namespace, NetworkPolicy, ClusterNetworkPolicy)


def _log_problems(key: PodKey, kind: str, new: NetworkPolicy | ClusterNetworkPolicy | None) -> None:
    """The problems that narrowed a policy, logged with its name once per change, not at
    each of its resyncs."""
    for problem in new.problems if new is not None else ():
        log.warning("%s %s: %s", kind, "/".join(filter(None, key)), problem)


class PolicyState:
    """`on_change` is called after each change that matters, and after every fresh list."""

    def __init__(self, node_name: str, on_change: Callable[[], None] = lambda: None) -> None:
        self.node_name = node_name
        self._on_change = on_change
        self._lock = threading.Lock()
        self._changed_pods: set[PodKey] | None = None
        """The pods changed since the last take; None when anything may have (a namespace's
        labels, a fresh list of pods)."""
        self._views = PodViews(node_name)
        self._pods = Store[Pod]("Pod", self._parse_pod, self._views.change)
        self._runtime: dict[PodKey, tuple[str, tuple[str, ...]]] = {}
        """This node's pods the runtime gave addresses the API has not: (uid, addresses)."""
        self._unaddressed: dict[PodKey, Obj] = {}
        """This node's pods the API knows without an address yet, as watched."""
        self.takes = 0
        """Snapshots taken."""
        self._namespaces = Store[Namespace]("Namespace", parse_namespace)
        self._staged = 0
        """The staged policies and cluster policies held."""
        self._policies = Store[NetworkPolicy](
            "NetworkPolicy", parse_policy, self._policy_changed("NetworkPolicy")
        )
        self._cluster_policies = Store[ClusterNetworkPolicy](
            "ClusterNetworkPolicy",
            parse_cluster_policy,
            self._policy_changed("ClusterNetworkPolicy"),
        )
        self._stores = (self._pods, self._namespaces, self._policies, self._cluster_policies)

    def _policy_changed(self, kind: str) -> Callable[[PodKey, Any, Any], None]:
        """What a policy's store hears on a change (under the lock): its problems logged, and
        the staged ones counted."""

        def changed(
            key: PodKey,
            old: NetworkPolicy | ClusterNetworkPolicy | None,
            new: NetworkPolicy | ClusterNetworkPolicy | None,
        ) -> None:
            _log_problems(key, kind, new)
            self._staged += (new is not None and new.staged) - (old is not None and old.staged)

        return changed

    def ready(self) -> bool:
        with self._lock:
            return all(store.listed for store in self._stores)

    def take(self) -> tuple[Cluster, set[PodKey] | None]:
        """The cluster now, and the pods changed since the last take (None: anything may
        have)."""
        with self._lock:
            by_namespace, local = self._views.snapshot()
            cluster = Cluster(
                self.node_name,
                dict(self._pods.items),
                {name: ns for (_, name), ns in self._namespaces.items.items()},
                tuple(self._policies.items.values()),
                tuple(self._cluster_policies.items.values()),
                by_namespace=by_namespace,
                local=local,
                staged=self._staged > 0,
            )
            changed, self._changed_pods = self._changed_pods, set()
            self.takes += 1
            return cluster, changed

    def _parse_pod(self, obj: Obj) -> Pod | None:
        uid, addresses = self._runtime.get(key_of(obj), ("", ()))
        # a pod of the same name made anew is another pod: its sandbox has no address yet
        same = uid in ("", (obj.get("metadata") or {}).get("uid"))
        return parse_pod(obj, addresses if same else ())

    def _watched_pod(self, key: PodKey, obj: Obj | None) -> None:
        """Under the lock: keep this node's pods without an address, and forget what the
        runtime said once the API has the pod's addresses or the pod is gone."""
        spec, status = (obj or {}).get("spec"), (obj or {}).get("status")
        # the objects are as the API server accepted them, or not: parse_pod says which
        spec = spec if isinstance(spec, dict) else {}
        status = status if isinstance(status, dict) else {}
        if obj is not None and spec.get("nodeName") == self.node_name and not status.get("podIPs"):
            self._unaddressed[key] = obj
            return
        self._unaddressed.pop(key, None)
        self._runtime.pop(key, None)

    def runtime_addresses(
        self, namespace: str, name: str, uid: str, addresses: tuple[str, ...]
    ) -> int | None:
        """The runtime gave a pod of this node these addresses (empty: took them back). If
        the API knows the pod without an address, the snapshots taken so far (the next one
        has the pod with these addresses, and a sync is queued for it); else None."""
        key = (namespace, name)
        with self._lock:
            if addresses:
                self._runtime[key] = (uid, addresses)
            else:
                self._runtime.pop(key, None)
            obj = self._unaddressed.get(key)
            if obj is None:
                return None
            if self._pods.set(key, obj) and self._changed_pods is not None:
                self._changed_pods.add(key)
            taken = self.takes
        self._on_change()
        return taken

    def _event(self, store: Store[Parsed], kind: str, obj: Obj) -> None:
        key = key_of(obj)
        with self._lock:
            if store is self._pods:
                self._watched_pod(key, None if kind == "DELETED" else obj)
            changed = store.event(kind, obj)
            if changed and store is self._pods and self._changed_pods is not None:
                self._changed_pods.add(key)
            elif changed and store is self._namespaces:
                self._changed_pods = None
        if changed:
            self._on_change()

    def _replace(self, store: Store[Parsed], objs: list[Obj]) -> None:
        """Take a fresh list's objects; the list is emptied, so that the watch's objects
        are freed here, before the sync is queued, rather than by the watch thread while
        that sync runs, holding the interpreter, which the sync would wait for
        (docs/benchmarks.md#networkpolicy-make-bench-policy)."""
        with self._lock:
            if store is self._pods:
                # keys only: nothing here may hold the listed objects past objs.clear()
                listed = set()
                for obj in objs:
                    listed.add(key_of(obj))
                    self._watched_pod(key_of(obj), obj)
                for key in self._unaddressed.keys() - listed:
                    self._watched_pod(key, None)
            if store.replace(objs) and store in (self._pods, self._namespaces):
                self._changed_pods = None
        objs.clear()
        self._on_change()

    def pod_event(self, kind: str, obj: Obj) -> None:
        self._event(self._pods, kind, obj)

    def namespace_event(self, kind: str, obj: Obj) -> None:
        self._event(self._namespaces, kind, obj)

    def policy_event(self, kind: str, obj: Obj) -> None:
        self._event(self._policies, kind, obj)

    def replace_pods(self, objs: list[Obj]) -> None:
        self._replace(self._pods, objs)

    def replace_namespaces(self, objs: list[Obj]) -> None:
        self._replace(self._namespaces, objs)

    def replace_policies(self, objs: list[Obj]) -> None:
        self._replace(self._policies, objs)

    def cluster_policy_event(self, kind: str, obj: Obj) -> None:
        self._event(self._cluster_policies, kind, obj)

    def replace_cluster_policies(self, objs: list[Obj]) -> None:
        self._replace(self._cluster_policies, objs)
