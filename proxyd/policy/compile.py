"""Pure: the policies, pods and namespaces of the cluster -> what this node enforces, per IP
family, in the terms of nftables' sets and rules.

Each direction of a pod on this node that any policy judges gets a chain: first the Admin
tier's ClusterNetworkPolicy rules that select the pod (by priority, then name, then as
written), then either the allowing rules of the NetworkPolicies isolating the pod in that
direction, anything else dropped, or, when none isolates it, the Baseline tier's rules,
anything else allowed. An Admin Pass jumps over the Admin rules after it, to a second chain
holding the rest. The packet reaches the pod's chain through a verdict map keyed by the pod's
address, so the cost of the first packet does not grow with the number of pods. A rule's
peers are a named set of addresses (pods by selector and ipBlocks or networks, with `except`
carved out: an interval set where the peers have an ipBlock of the family, a hash set of
addresses, cheaper to load, where they do not), named after what the peers say, so every
rule of every policy with the same peers shares one set (computed once), and a pod's label
change adds or removes elements and leaves the chains as they are.

Named ports resolve against the pod that receives the traffic: for ingress that is the
chain's own pod, so they become numbers in its chain; for egress it is the peer, so they
become a set of (peer address . protocol . port) elements.

Compiled with `provenance` (for `kubectl knit explain`, never by the daemon), each match
also carries the policy rule it comes from (`Origin`), and the table names the
NetworkPolicies isolating each pod's chain: the same compile as the daemon's, so an
explanation gives the daemon's verdict.

Staged policies (model.STAGED_ANNOTATION) are left out, so that what is enforced is exactly
what it would be without them; compiled as the staged view (`staged_view`, for flow records
and `kubectl knit explain`, never written as it is), they are compiled as if enforced.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import ipaddress
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from proxyd.naming import short_hash
from proxyd.policy.cluster_model import (
    ACCEPT,
    ADMIN,
    BASELINE,
    DENY,
    ClusterNetworkPolicy,
    ClusterRule,
)
from proxyd.policy.model import (
    DIRECTIONS,
    INGRESS,
    IpBlock,
    Namespace,
    NetworkPolicy,
    Peer,
    Pod,
    PortMatch,
    Rule,
    Selector,
)

PodKey = tuple[str, str]
Interval = tuple[int, int]
PeersKey = tuple[str, tuple[Peer, ...]]
ALLOW = "allow"
DROP = "drop"
NEXT = "next"
"""Verdicts: let the packet on (to the receiver's ingress, after an egress chain), drop it
(counted), or go to the pod's next chain (an Admin Pass)."""
NETWORK_POLICY = "NetworkPolicy"
CLUSTER_NETWORK_POLICY = "ClusterNetworkPolicy"
NETWORK_POLICY_TIER = "NetworkPolicy"
"""The tier between Admin and Baseline, as network-policy-api names it."""


@dataclass(frozen=True, slots=True)
class Origin:
    """The policy rule a match comes from: `rule` is its index among the object's rules of
    the direction (one knit left out as unreadable keeps its place); `namespace` is "" and
    `priority` is set for a ClusterNetworkPolicy; `action` is the rule's (Accept, Deny or
    Pass; a NetworkPolicy's rules Accept)."""

    kind: str
    namespace: str
    name: str
    tier: str
    rule: int
    action: str
    priority: int | None = None
    rule_name: str = ""


@dataclass(frozen=True)
class Match:
    """Traffic one rule matches into (or out of) a pod: from `peers` (a peer set's name; None
    any address), on `protocol` (None any) and ports `first`..`last` (None: any), or to the
    (address . protocol . port) elements of the peer-port set `peer_ports`; and what is done
    with it."""

    peers: str | None = None
    protocol: str | None = None
    first: int | None = None
    last: int | None = None
    peer_ports: str | None = None
    verdict: str = ALLOW
    origin: Origin | None = field(default=None, compare=False)
    """Set only by a compile with provenance; not part of the rule (two equal matches of
    one chain keep the first's, the one that decides)."""


@dataclass(frozen=True)
class PodChain:
    """A pod chain: its matches in order, then `otherwise`; `counter` (the pod's first chain)
    counts what it drops, `next` is where NEXT goes."""

    matches: tuple[Match, ...]
    otherwise: str
    counter: str
    next: str | None = None


@dataclass
class FamilyPolicy:
    """What one family's table must hold."""

    chains: dict[str, PodChain] = field(default_factory=dict)
    """Pod chain name -> its rules; a chain comes after the chains it goes to."""
    ingress: dict[str, str] = field(default_factory=dict)
    """Address of a pod judged for ingress -> its first chain."""
    egress: dict[str, str] = field(default_factory=dict)
    peers: dict[str, frozenset[Interval]] = field(default_factory=dict)
    """Peer set name -> its address intervals (inclusive, as integers)."""
    ranged: set[str] = field(default_factory=set)
    """The peer sets with an ipBlock of the family: the only ones whose intervals may be
    ranges (the others hold single addresses, whatever their pods)."""
    peer_ports: dict[str, frozenset[tuple[str, str, int]]] = field(default_factory=dict)
    """Peer-port set name -> (address, protocol, port) elements."""
    owners: dict[str, PodKey] = field(default_factory=dict)
    """A pod's first chain (the counter's name) -> its pod, for comments and metrics."""
    isolating: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """A pod's first chain -> the policies judging its pod in its direction, for metrics."""
    local: frozenset[str] = frozenset()
    """Addresses of this node's pods: a pod's traffic to itself always passes."""
    quarantined: frozenset[str] = frozenset()
    """Pods' first chains that drop everything because nft refused their rules (see
    quarantine.py); the compiler makes none."""
    isolated_by: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """With provenance only: a pod's first chain -> the NetworkPolicies (of the pod's
    namespace) isolating it in the chain's direction; absent when none does."""


class PodViews:
    """The pods by namespace and the pods of this node, kept as pods change (by the policy
    state), so that a snapshot need not go over every pod to make them: it takes the
    namespaces' dicts as they are, and a namespace's dict is copied only when it next
    changes."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self._by_namespace: dict[str, dict[PodKey, Pod]] = {}
        self._local: dict[PodKey, Pod] = {}
        self._taken: set[str] = set()
        """Namespaces whose dict the last snapshot holds."""

    def _pods_of(self, namespace: str) -> dict[PodKey, Pod]:
        pods = self._by_namespace.get(namespace)
        if pods is None or namespace in self._taken:
            pods = self._by_namespace[namespace] = dict(pods or {})
            self._taken.discard(namespace)
        return pods

    def change(self, key: PodKey, old: Pod | None, new: Pod | None) -> None:
        if old is not None:
            pods = self._pods_of(old.namespace)
            del pods[key]
            if not pods:
                del self._by_namespace[old.namespace]
        if new is not None:
            self._pods_of(new.namespace)[key] = new
        if new is not None and new.node == self.node_name:
            self._local[key] = new
        else:
            self._local.pop(key, None)

    def snapshot(self) -> tuple[dict[str, dict[PodKey, Pod]], dict[PodKey, Pod]]:
        self._taken = set(self._by_namespace)
        return dict(self._by_namespace), dict(self._local)


@dataclass(frozen=True)
class Cluster:
    """One snapshot of what policies depend on; both families compile the same one."""

    node: str
    pods: Mapping[PodKey, Pod]
    namespaces: Mapping[str, Namespace]
    policies: tuple[NetworkPolicy, ...]
    cluster_policies: tuple[ClusterNetworkPolicy, ...] = ()
    by_namespace: Mapping[str, Mapping[PodKey, Pod]] = field(kw_only=True)
    """The pods of each namespace: where a new peer set looks for its members."""
    local: Mapping[PodKey, Pod] = field(kw_only=True)
    """The pods of this node: the pods that get chains."""
    staged: bool = field(default=False, kw_only=True)
    """Whether any of the policies is staged (counted by the policy state as they change, so
    that a cluster without one is not looked over for them at each sync). Wrongly False, it
    has the staged policies enforced: never less protection."""
    _selected: dict[tuple[str, Selector], list[tuple[PodKey, Pod]]] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def selected(self, namespace: str, selector: Selector) -> list[tuple[PodKey, Pod]]:
        """The pods of the namespace that the selector selects. Remembered: both families
        compile the same snapshot, and peer sets of either family share their selectors,
        so the labels of a namespace's pods are matched once per selector and sync."""
        found = self._selected.get((namespace, selector))
        if found is None:
            matches = selector.matches
            pods = self.by_namespace.get(namespace, {})
            found = [(key, pod) for key, pod in pods.items() if matches(pod.labels)]
            self._selected[namespace, selector] = found
        return found

    @classmethod
    def of(
        cls,
        node: str,
        pods: Mapping[PodKey, Pod],
        namespaces: Mapping[str, Namespace],
        policies: tuple[NetworkPolicy, ...],
        cluster_policies: tuple[ClusterNetworkPolicy, ...] = (),
    ) -> Cluster:
        """The snapshot with its views made from `pods` at once (the policy state keeps a
        PodViews as pods change instead)."""
        views = PodViews(node)
        for key, pod in pods.items():
            views.change(key, None, pod)
        by_namespace, local = views.snapshot()
        return cls(
            node,
            pods,
            namespaces,
            policies,
            cluster_policies,
            by_namespace=by_namespace,
            local=local,
            staged=any(p.staged for p in policies) or any(p.staged for p in cluster_policies),
        )


@functools.lru_cache(maxsize=1 << 16)
def chain_name(direction: str, pod: PodKey) -> str:
    prefix = "ingress" if direction == INGRESS else "egress"
    return f"{prefix}-{short_hash('/'.join(pod))}"


def _peers_key(namespace: str, peers: tuple[Peer, ...]) -> PeersKey:
    """What the peers select, equal for equal selections: a pod peer without a namespace
    selector means the policy's own namespace (a cluster policy has none)."""
    own = any(peer.block is None and peer.namespaces is None for peer in peers)
    return (namespace if own else "", peers)


def _intervals(block: IpBlock, family: int) -> list[Interval]:
    """The block's addresses less its `except`s, in one sweep over the holes in order
    (linear in the number of holes once sorted, where carving each from every piece was
    quadratic: docs/benchmarks.md#networkpolicy-make-bench-policy)."""
    if block.family != family:
        return []
    network = ipaddress.ip_network(block.cidr)
    cursor, last = int(network[0]), int(network[-1])
    kept = []
    for low, high in sorted(merged(_span(text) for text in block.excepted)):
        if low > cursor:
            kept.append((cursor, low - 1))
        cursor = max(cursor, high + 1)
    if cursor <= last:
        kept.append((cursor, last))
    return kept


def _span(cidr: str) -> Interval:
    network = ipaddress.ip_network(cidr)
    return int(network[0]), int(network[-1])


def merged(intervals: Iterable[Interval]) -> frozenset[Interval]:
    """Overlapping or adjacent intervals joined: nft refuses overlapping elements."""
    out: list[list[int]] = []
    for first, last in sorted(intervals):
        if out and first <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], last)
        else:
            out.append([first, last])
    return frozenset((first, last) for first, last in out)


def _address(pod: Pod, family: int) -> tuple[str, int] | None:
    """The pod's address of the family, as text and as a number."""
    return pod.by_family.get(family)


def _inside(value: int, intervals: Iterable[Interval]) -> bool:
    return any(first <= value <= last for first, last in intervals)


@dataclass
class _PeerSet:
    """One peer selection's set, kept from compile to compile so that a change re-examines
    only the pods it touched, and changes its elements without going over the others."""

    name: str
    namespace: str
    """The namespace a pod peer without a namespace selector means."""
    peers: tuple[Peer, ...]
    blocks: frozenset[Interval]
    """The ipBlocks of the family, `except`s carved out, merged."""
    members: dict[PodKey, tuple[Pod, int]] = field(default_factory=dict)
    """Member pods and their address of the family."""
    intervals: frozenset[Interval] = frozenset()
    """The blocks, and each member address outside them (nft refuses overlapping elements;
    adjacent ones are fine)."""
    holders: Counter[int] = field(default_factory=Counter)
    """Member addresses outside the blocks, by how many members hold each (a stale pod may
    share its address with a new one)."""
    named_ports: dict[tuple[str, str], frozenset[tuple[str, str, int]]] = field(
        default_factory=dict
    )
    """(port name, protocol) -> (address, protocol, port) of that port on each member."""

    def __post_init__(self) -> None:
        self.intervals = self.blocks

    def selects(self, pod: Pod, value: int, namespaces: Mapping[str, Namespace]) -> bool:
        if self.blocks and _inside(value, self.blocks):
            return True
        for peer in self.peers:
            if peer.pods is None or not peer.pods.matches(pod.labels):
                continue
            if peer.namespaces is None:
                if pod.namespace == self.namespace:
                    return True
            elif (ns := namespaces.get(pod.namespace)) and peer.namespaces.matches(ns.labels):
                return True
        return False

    def fill(self, cluster: Cluster, index: _AddressIndex, family: int) -> None:
        """The first members: the pods inside the blocks, and those the pod peers select,
        looked for namespace by namespace (a namespace selector is matched once per
        namespace, not once per pod; adding members one by one would copy the set each
        time)."""
        for pod in index.inside(self.blocks, cluster.pods):
            if (address := _address(pod, family)) is not None:
                self.members[pod.namespace, pod.name] = (pod, address[1])
        for peer in self.peers:
            if peer.pods is None:
                continue
            if peer.namespaces is None:
                names = [self.namespace]
            else:
                selector = peer.namespaces
                names = [n for n, ns in cluster.namespaces.items() if selector.matches(ns.labels)]
            for name in names:
                for key, pod in cluster.selected(name, peer.pods):
                    if key not in self.members and (address := _address(pod, family)) is not None:
                        self.members[key] = (pod, address[1])
                        if not _inside(address[1], self.blocks):
                            self.holders[address[1]] += 1
        self.intervals = self.blocks | {(value, value) for value in self.holders}

    def add(self, key: PodKey, pod: Pod, value: int) -> None:
        self.members[key] = (pod, value)
        self.named_ports.clear()
        if not _inside(value, self.blocks):
            self.holders[value] += 1
            if self.holders[value] == 1:
                self.intervals = self.intervals | {(value, value)}

    def remove(self, key: PodKey) -> None:
        _, value = self.members.pop(key)
        self.named_ports.clear()
        if value in self.holders:
            self.holders[value] -= 1
            if not self.holders[value]:
                del self.holders[value]
                self.intervals = self.intervals - {(value, value)}

    def port_elements(self, port: PortMatch, family: int) -> frozenset[tuple[str, str, int]]:
        key = (port.name, port.protocol)
        if key not in self.named_ports:
            elements = set()
            for pod, _ in self.members.values():
                number = pod.port_named(port.name, port.protocol)
                address = _address(pod, family)
                if number is not None and address is not None:
                    elements.add((address[0], port.protocol.lower(), number))
            self.named_ports[key] = frozenset(elements)
        return self.named_ports[key]


class _AddressIndex:
    """One family's pod addresses in order, for the pods inside an ipBlock: made when an
    ipBlock first asks (policies without ipBlocks never pay for sorting every pod), then kept
    from compile to compile pod by pod."""

    def __init__(self, family: int) -> None:
        self.family = family
        self._sorted: list[tuple[int, str, str]] | None = None
        """(address, namespace, name); None until asked for."""

    def forget(self) -> None:
        self._sorted = None

    def change(self, key: PodKey, old: Pod | None, new: Pod | None) -> None:
        if self._sorted is None:
            return
        if old is not None and (address := _address(old, self.family)) is not None:
            del self._sorted[bisect.bisect_left(self._sorted, (address[1], *key))]
        if new is not None and (address := _address(new, self.family)) is not None:
            bisect.insort(self._sorted, (address[1], *key))

    def inside(self, intervals: Iterable[Interval], pods: Mapping[PodKey, Pod]) -> list[Pod]:
        """The pods with an address in the intervals; `pods` is the snapshot the index was
        last changed to."""
        found: list[Pod] = []
        if not intervals:
            return found
        if self._sorted is None:
            family = self.family
            self._sorted = sorted(
                (address[1], *key)
                for key, pod in pods.items()
                if (address := _address(pod, family)) is not None
            )
        for first, last in intervals:
            at = bisect.bisect_left(self._sorted, (first, "", ""))
            while at < len(self._sorted) and self._sorted[at][0] <= last:
                _, namespace, name = self._sorted[at]
                found.append(pods[(namespace, name)])
                at += 1
        return found


class FamilyCompiler:
    """Compiles one family's policy. The peer sets of one compile are kept for the next,
    which re-examines only the pods that changed (`changed_pods`; None: everything may have,
    as after a namespace's labels changed); when no policy and no pod of this node changed,
    the pod chains and maps are kept too and only the sets are refreshed. So a change to
    another node's pod costs the same with 1,000 pods as with 10,000. The result is what a
    fresh compile of the same cluster gives."""

    def __init__(self, family: int, *, provenance: bool = False, staged_view: bool = False) -> None:
        """`provenance`: give each match its Origin (for explaining verdicts); `staged_view`:
        compile the staged policies as if enforced (what they would do), where by default
        they are left out."""
        self.family = family
        self.provenance = provenance
        self.staged_view = staged_view
        self._peer_sets: dict[PeersKey, _PeerSet] = {}
        self.port_sets: dict[str, tuple[_PeerSet | None, PortMatch]] = {}
        """The last compile's peer-port sets: what each was made from."""
        self.local: set[PodKey] = set()
        """The last compile's pods of this node."""
        self._last: FamilyPolicy | None = None
        self._last_policies: tuple[NetworkPolicy | ClusterNetworkPolicy, ...] = ()
        self.index = _AddressIndex(family)
        self._pods: Mapping[PodKey, Pod] = {}
        """The snapshot of the last compile."""

    def compile(self, cluster: Cluster, changed_pods: Iterable[PodKey] | None) -> FamilyPolicy:
        last_pods, self._pods = self._pods, cluster.pods
        if changed_pods is None:
            self._peer_sets.clear()
            self._last = None
            self.index.forget()
        else:
            changed = set(changed_pods)
            for key in changed:
                self.index.change(key, last_pods.get(key), cluster.pods.get(key))
            self._update(cluster, changed)
            if self._last is not None and self._chains_hold(cluster, changed):
                self._last = self._refreshed(self._last, cluster, bool(changed))
                return self._last
        self._last = _TableBuild(self, cluster).result()
        policies, cluster_policies = self.compiled(cluster)
        self._last_policies = (*policies, *cluster_policies)
        return self._last

    def compiled(
        self, cluster: Cluster
    ) -> tuple[tuple[NetworkPolicy, ...], tuple[ClusterNetworkPolicy, ...]]:
        """The cluster's policies and cluster policies this compiler compiles: all in the
        staged view, else the ones not staged."""
        if self.staged_view or not cluster.staged:
            return cluster.policies, cluster.cluster_policies
        return (
            tuple(policy for policy in cluster.policies if not policy.staged),
            tuple(policy for policy in cluster.cluster_policies if not policy.staged),
        )

    def _chains_hold(self, cluster: Cluster, changed: set[PodKey]) -> bool:
        """Whether the last compile's chains and maps still hold: the same policies (the
        same objects: the state replaces a policy's object when it changes) and no change to
        a pod of this node."""
        compiled, cluster_compiled = self.compiled(cluster)
        policies = (*compiled, *cluster_compiled)
        if len(policies) != len(self._last_policies) or any(
            now is not was for now, was in zip(policies, self._last_policies, strict=True)
        ):
            return False
        for key in changed:
            pod = cluster.pods.get(key)
            if key in self.local or (pod is not None and pod.node == cluster.node):
                return False
        return True

    def _refreshed(self, last: FamilyPolicy, cluster: Cluster, changed: bool) -> FamilyPolicy:
        """The last compile with its sets' elements as they are now."""
        peer_ports = {}
        for name, (entry, port) in self.port_sets.items():
            if entry is not None:
                peer_ports[name] = entry.port_elements(port, self.family)
            elif changed:
                peer_ports[name] = _everyone(cluster, port, self.family)
            else:
                peer_ports[name] = last.peer_ports[name]
        peers = {entry.name: entry.intervals for entry in self._peer_sets.values()}
        return dataclasses.replace(last, peers=peers, peer_ports=peer_ports)

    def _update(self, cluster: Cluster, changed: set[PodKey]) -> None:
        for entry in self._peer_sets.values():
            for key in changed:
                pod = cluster.pods.get(key)
                address = _address(pod, self.family) if pod is not None else None
                wanted = (
                    pod is not None
                    and address is not None
                    and entry.selects(pod, address[1], cluster.namespaces)
                )
                held = entry.members.get(key)
                if held is not None and (not wanted or held[0] != pod):
                    entry.remove(key)
                if wanted and pod is not None and address is not None and held != (pod, address[1]):
                    entry.add(key, pod, address[1])

    def peer_set(
        self, cluster: Cluster, namespace: str, peers: tuple[Peer, ...], build: _TableBuild
    ) -> _PeerSet:
        """The set of the peers of a rule of a policy of `namespace` ("" for a cluster
        policy)."""
        key = _peers_key(namespace, peers)
        entry = self._peer_sets.get(key)
        if entry is None:
            blocks = merged(
                interval
                for peer in peers
                if peer.block is not None
                for interval in _intervals(peer.block, self.family)
            )
            entry = _PeerSet(f"peers-{short_hash(repr(key))}", key[0], peers, blocks)
            entry.fill(cluster, self.index, self.family)
            self._peer_sets[key] = entry
        build.used.add(key)
        return entry

    def forget_unused(self, used: set[PeersKey]) -> None:
        for key in self._peer_sets.keys() - used:
            del self._peer_sets[key]


class _TableBuild:
    """A family's table being built by one full compile: the pod chains of this node's pods
    and the sets they name (`out`), and which of the compiler's kept peer sets it used."""

    def __init__(self, compiler: FamilyCompiler, cluster: Cluster) -> None:
        self.compiler = compiler
        self.cluster = cluster
        self.family = compiler.family
        self.out = FamilyPolicy()
        self.used: set[PeersKey] = set()
        self.policies, self.cluster_policies = compiler.compiled(cluster)

    def matches(
        self,
        namespace: str,
        direction: str,
        rule_peers: tuple[Peer, ...] | None,
        rule_ports: tuple[PortMatch, ...] | None,
        pod: Pod,
        verdict: str = ALLOW,
        origin: Origin | None = None,
    ) -> list[Match]:
        """What one rule of a policy of `namespace` ("" for a cluster policy) matches for
        the pod."""
        entry = None
        if rule_peers is not None:
            entry = self.compiler.peer_set(self.cluster, namespace, rule_peers, self)
            self.out.peers[entry.name] = entry.intervals
            if entry.blocks:
                self.out.ranged.add(entry.name)
        peers = entry.name if entry is not None else None
        if rule_ports is None:
            return [Match(peers, verdict=verdict, origin=origin)]
        matches = []
        for port in rule_ports:
            protocol = port.protocol.lower()
            if port.name and direction == INGRESS:
                number = pod.port_named(port.name, port.protocol)
                if number is not None:
                    matches.append(
                        Match(peers, protocol, number, number, verdict=verdict, origin=origin)
                    )
            elif port.name:
                # egress: the name resolves on each destination pod among the peers
                peer_ports = self.peer_ports(entry, port)
                matches.append(Match(peer_ports=peer_ports, verdict=verdict, origin=origin))
            elif port.number is not None:
                last = port.end or port.number
                matches.append(
                    Match(peers, protocol, port.number, last, verdict=verdict, origin=origin)
                )
            else:
                matches.append(Match(peers, protocol, verdict=verdict, origin=origin))
        return matches

    def peer_ports(self, entry: _PeerSet | None, port: PortMatch) -> str:
        """The name of the set of (address . protocol . port) of the named port on each peer
        pod (entry None: any pod)."""
        name = f"peer-ports-{short_hash(f'{entry and entry.name}/{port.protocol}/{port.name}')}"
        if entry is not None:
            self.out.peer_ports[name] = entry.port_elements(port, self.family)
        elif name not in self.out.peer_ports:
            self.out.peer_ports[name] = _everyone(self.cluster, port, self.family)
        self.compiler.port_sets[name] = (entry, port)
        return name

    def cluster_rules(
        self, policies: list[ClusterNetworkPolicy], direction: str, pod: Pod, passing: str
    ) -> tuple[list[Match], list[str]]:
        """The matches of a tier's rules that apply to the pod, in order, a Pass becoming
        `passing`; and the names of the policies they come from."""
        namespace = self.cluster.namespaces.get(pod.namespace)
        found: list[Match] = []
        names = []
        for policy in policies:
            subject = policy.subject
            if not (
                policy.rules(direction)
                and namespace is not None
                and subject.namespaces is not None
                and subject.namespaces.matches(namespace.labels)
                and subject.pods is not None
                and subject.pods.matches(pod.labels)
            ):
                continue
            names.append(policy.name)
            for rule in policy.rules(direction):
                verdict = (
                    ALLOW if rule.action == ACCEPT else DROP if rule.action == DENY else passing
                )
                origin = _cluster_origin(policy, rule) if self.compiler.provenance else None
                found += self.matches("", direction, rule.peers, rule.ports, pod, verdict, origin)
        return found, names

    def pod_chains(
        self,
        pod: Pod,
        address: str,
        direction: str,
        isolation: tuple[list[str], list[Match]] | None,
        tiers: tuple[list[ClusterNetworkPolicy], list[ClusterNetworkPolicy]],
    ) -> None:
        """The pod's chains for the direction, if any policy judges it there; `isolation`:
        the NetworkPolicies isolating it and what they allow."""
        admin, baseline = tiers
        first = chain_name(direction, (pod.namespace, pod.name))
        rest = f"{first}-next"
        admin_matches, names = self.cluster_rules(admin, direction, pod, NEXT)
        if isolation is not None:
            isolating, rest_matches = isolation
            names += isolating
            otherwise = DROP
        else:
            # a Baseline Pass leaves the decision to the default: allowed
            rest_matches, baseline_names = self.cluster_rules(baseline, direction, pod, ALLOW)
            names += baseline_names
            otherwise = ALLOW
        if not names:
            return
        if any(match.verdict == NEXT for match in admin_matches):
            self.out.chains[rest] = PodChain(tuple(dict.fromkeys(rest_matches)), otherwise, first)
            matches, otherwise, after = admin_matches, NEXT, rest
        else:
            matches, after = admin_matches + rest_matches, None
        self.out.chains[first] = PodChain(tuple(dict.fromkeys(matches)), otherwise, first, after)
        self.out.owners[first] = (pod.namespace, pod.name)
        self.out.isolating[first] = tuple(names)
        if isolation is not None and self.compiler.provenance:
            self.out.isolated_by[first] = tuple(isolation[0])
        target = self.out.ingress if direction == INGRESS else self.out.egress
        target[address] = first

    def result(self) -> FamilyPolicy:
        local: dict[str, list[tuple[Pod, str]]] = {}
        self.compiler.local = set()
        self.compiler.port_sets = {}
        for key, pod in self.cluster.local.items():
            self.compiler.local.add(key)
            if found := _address(pod, self.family):
                local.setdefault(pod.namespace, []).append((pod, found[0]))
        self.out.local = frozenset(a for pods in local.values() for _, a in pods)
        isolation: dict[tuple[str, PodKey], tuple[list[str], list[Match]]] = {}
        # only the policies of namespaces with a pod here select one: the others are not
        # sorted, nor looked at again
        judging = [policy for policy in self.policies if policy.namespace in local]
        for policy in sorted(judging, key=lambda p: (p.namespace, p.name)):
            for pod, _ in local[policy.namespace]:
                if not policy.pods.matches(pod.labels):
                    continue
                for direction in sorted(policy.directions):
                    names, allowed = isolation.setdefault(
                        (direction, (pod.namespace, pod.name)), ([], [])
                    )
                    names.append(policy.name)
                    for rule in policy.rules(direction):
                        origin = _origin(policy, rule) if self.compiler.provenance else None
                        allowed += self.matches(
                            policy.namespace, direction, rule.peers, rule.ports, pod, ALLOW, origin
                        )
        ordered = sorted(self.cluster_policies, key=lambda p: (p.priority, p.name))
        tiers = (
            [policy for policy in ordered if policy.tier == ADMIN],
            [policy for policy in ordered if policy.tier == BASELINE],
        )
        for namespace in sorted(local):
            for pod, address in sorted(local[namespace], key=lambda found: found[0].name):
                for direction in DIRECTIONS:
                    isolated = isolation.get((direction, (pod.namespace, pod.name)))
                    self.pod_chains(pod, address, direction, isolated, tiers)
        self.compiler.forget_unused(self.used)
        return self.out


def _origin(policy: NetworkPolicy, rule: Rule) -> Origin:
    return Origin(
        NETWORK_POLICY, policy.namespace, policy.name, NETWORK_POLICY_TIER, rule.index, ACCEPT
    )


def _cluster_origin(policy: ClusterNetworkPolicy, rule: ClusterRule) -> Origin:
    return Origin(
        CLUSTER_NETWORK_POLICY, "", policy.name, policy.tier, rule.index, rule.action,
        policy.priority, rule.name,
    )  # fmt: skip


def _everyone(cluster: Cluster, port: PortMatch, family: int) -> frozenset[tuple[str, str, int]]:
    """The named port's (address . protocol . port) on every pod."""
    everyone = _PeerSet("", "", (), frozenset())
    for key, pod in cluster.pods.items():
        everyone.members[key] = (pod, 0)
    return everyone.port_elements(port, family)


def compile_family(
    cluster: Cluster, family: int, *, provenance: bool = False, staged_view: bool = False
) -> FamilyPolicy:
    """A fresh compile of one family; `provenance`: with each match's Origin; `staged_view`:
    with the staged policies compiled as if enforced."""
    compiler = FamilyCompiler(family, provenance=provenance, staged_view=staged_view)
    return compiler.compile(cluster, None)
