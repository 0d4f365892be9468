"""The NetworkPolicies, ClusterNetworkPolicies, Pods and Namespaces as the watches delivered
them, parsed.

Watch threads feed it; the policy's sync thread takes a consistent snapshot. A change that
does not alter what policies depend on (a pod's status conditions, say) queues no sync. An
object that cannot be parsed is logged with its namespace and name; a pod or namespace so
broken is left out (a pod that is in no peer set is denied by every isolating policy, so
leaving it out never widens), and a policy's problems narrow it (see model).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from proxyd.model import Obj, key_of, parse_or_skip
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

log = logging.getLogger(__name__)

Parsed = TypeVar("Parsed", Pod, Namespace, NetworkPolicy, ClusterNetworkPolicy)


class _Store(Generic[Parsed]):
    """One kind of object by (namespace, name); `on_set` hears each change, with the object
    it replaced and the one that replaced it."""

    def __init__(
        self,
        kind: str,
        parse: Callable[[Obj], Parsed | None],
        on_set: Callable[[PodKey, Parsed | None, Parsed | None], None] = lambda *_: None,
    ) -> None:
        self.kind = kind
        self._parse: Callable[[Obj], Parsed | None] = parse
        self._on_set: Callable[[PodKey, Parsed | None, Parsed | None], None] = on_set
        self.items: dict[PodKey, Parsed] = {}
        self.listed = False

    def set(self, key: PodKey, obj: Obj | None) -> bool:
        """Whether what is stored changed."""
        parsed = parse_or_skip(self._parse, obj, self.kind) if obj is not None else None
        old = self.items.get(key)
        if parsed == old:
            return False
        if isinstance(parsed, NetworkPolicy | ClusterNetworkPolicy):
            for problem in parsed.problems:
                log.warning("%s %s: %s", self.kind, "/".join(filter(None, key)), problem)
        if parsed is None:
            del self.items[key]
        else:
            self.items[key] = parsed
        self._on_set(key, old, parsed)
        return True

    def replace(self, objs: list[Obj]) -> bool:
        present = {key_of(obj): obj for obj in objs}
        changed = [self.set(key, None) for key in list(self.items.keys() - present.keys())]
        changed += [self.set(key, obj) for key, obj in present.items()]
        self.listed = True
        return any(changed)


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
        self._pods = _Store[Pod]("Pod", parse_pod, self._views.change)
        self._namespaces = _Store[Namespace]("Namespace", parse_namespace)
        self._policies = _Store[NetworkPolicy]("NetworkPolicy", parse_policy)
        self._cluster_policies = _Store[ClusterNetworkPolicy](
            "ClusterNetworkPolicy", parse_cluster_policy
        )
        self._stores = (self._pods, self._namespaces, self._policies, self._cluster_policies)

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
            )
            changed, self._changed_pods = self._changed_pods, set()
            return cluster, changed

    def _event(self, store: _Store[Parsed], kind: str, obj: Obj) -> None:
        key = key_of(obj)
        with self._lock:
            changed = store.set(key, None if kind == "DELETED" else obj)
            if changed and store is self._pods and self._changed_pods is not None:
                self._changed_pods.add(key)
            elif changed and store is self._namespaces:
                self._changed_pods = None
        if changed:
            self._on_change()

    def _replace(self, store: _Store[Parsed], objs: list[Obj]) -> None:
        """Take a fresh list's objects; the list is emptied, so that the watch's objects
        are freed here, before the sync is queued, rather than by the watch thread while
        that sync runs, holding the interpreter, which the sync would wait for
        (docs/benchmarks.md#networkpolicy-make-bench-policy)."""
        with self._lock:
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
