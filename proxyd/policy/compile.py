"""Pure: the policies, pods and namespaces of the cluster -> what this node enforces, per IP
family, in the terms of nftables' sets and rules.

Each isolated direction of a pod on this node gets a chain holding one allowing rule per
(policy rule, port) that selects it; the packet reaches that chain through a verdict map
keyed by the pod's address, so the cost of the first packet does not grow with the number of
pods. A rule's peers are a named interval set of addresses (pods by selector and ipBlocks,
with `except` carved out), named after what the peers say, so every rule of every policy
with the same peers shares one set (computed once), and a pod's label change adds or removes
elements and leaves the chains as they are.

Named ports resolve against the pod that receives the traffic: for ingress that is the
chain's own pod, so they become numbers in its chain; for egress it is the peer, so they
become a set of (peer address . protocol . port) elements.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from proxyd.model import family_of
from proxyd.naming import short_hash
from proxyd.policy.model import (
    INGRESS,
    IpBlock,
    Namespace,
    NetworkPolicy,
    Peer,
    Pod,
    PortMatch,
    Rule,
)

PodKey = tuple[str, str]
Interval = tuple[int, int]


@dataclass(frozen=True)
class Allow:
    """Traffic one rule allows into (or out of) a pod: from `peers` (a peer set's name; None
    any address), on `protocol` (None any) and ports `first`..`last` (None: any), or to the
    (address . protocol . port) elements of the peer-port set `peer_ports`."""

    peers: str | None = None
    protocol: str | None = None
    first: int | None = None
    last: int | None = None
    peer_ports: str | None = None


@dataclass
class FamilyPolicy:
    """What one family's table must hold."""

    chains: dict[str, tuple[Allow, ...]] = field(default_factory=dict)
    """Pod chain name -> its allowing rules (anything else is dropped)."""
    ingress: dict[str, str] = field(default_factory=dict)
    """Address of a pod isolated for ingress -> its chain."""
    egress: dict[str, str] = field(default_factory=dict)
    peers: dict[str, frozenset[Interval]] = field(default_factory=dict)
    """Peer set name -> its address intervals (inclusive, as integers)."""
    peer_ports: dict[str, frozenset[tuple[str, str, int]]] = field(default_factory=dict)
    """Peer-port set name -> (address, protocol, port) elements."""
    owners: dict[str, PodKey] = field(default_factory=dict)
    """Pod chain name -> its pod, for comments."""
    isolating: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Pod chain name -> the policies isolating its pod in its direction, for metrics."""
    local: frozenset[str] = frozenset()
    """Addresses of this node's pods: a pod's traffic to itself always passes."""


@dataclass(frozen=True)
class Cluster:
    node: str
    pods: Mapping[PodKey, Pod]
    namespaces: Mapping[str, Namespace]
    policies: tuple[NetworkPolicy, ...]


def chain_name(direction: str, pod: PodKey) -> str:
    prefix = "ingress" if direction == INGRESS else "egress"
    return f"{prefix}-{short_hash('/'.join(pod))}"


def _peers_key(policy: NetworkPolicy, peers: tuple[Peer, ...]) -> str:
    """What the peers select, in words that differ when the selection may: a pod peer without
    a namespace selector means the policy's own namespace."""
    own = any(peer.block is None and peer.namespaces is None for peer in peers)
    return repr((policy.namespace if own else "", peers))


def _intervals(block: IpBlock, family: int) -> list[Interval]:
    if block.family != family:
        return []
    network = ipaddress.ip_network(block.cidr)
    kept = [(int(network[0]), int(network[-1]))]
    for text in block.excepted:
        carved = ipaddress.ip_network(text)
        low, high = int(carved[0]), int(carved[-1])
        kept = [
            piece
            for first, last in kept
            for piece in ((first, min(last, low - 1)), (max(first, high + 1), last))
            if piece[0] <= piece[1]
        ]
    return kept


def merged(intervals: Iterable[Interval]) -> frozenset[Interval]:
    """Overlapping or adjacent intervals joined: nft refuses overlapping elements."""
    out: list[list[int]] = []
    for first, last in sorted(intervals):
        if out and first <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], last)
        else:
            out.append([first, last])
    return frozenset((first, last) for first, last in out)


def _inside(address: str, intervals: Iterable[Interval]) -> bool:
    value = int(ipaddress.ip_address(address))
    return any(first <= value <= last for first, last in intervals)


class _Compiler:
    def __init__(self, cluster: Cluster, family: int) -> None:
        self.cluster = cluster
        self.family = family
        self.by_namespace: dict[str, list[Pod]] = {}
        for pod in cluster.pods.values():
            self.by_namespace.setdefault(pod.namespace, []).append(pod)
        self.out = FamilyPolicy()
        self._peer_pods: dict[str, list[Pod]] = {}

    def address(self, pod: Pod) -> str | None:
        return next((a for a in pod.addresses if family_of(a) == self.family), None)

    def _namespaces(self, policy: NetworkPolicy, peer: Peer) -> list[str]:
        if peer.namespaces is None:
            return [policy.namespace]
        return [
            name
            for name, namespace in self.cluster.namespaces.items()
            if peer.namespaces.matches(namespace.labels)
        ]

    def _pods_of(self, policy: NetworkPolicy, peer: Peer) -> list[Pod]:
        assert peer.pods is not None
        return [
            pod
            for namespace in self._namespaces(policy, peer)
            for pod in self.by_namespace.get(namespace, [])
            if peer.pods.matches(pod.labels)
        ]

    def peer_set(self, policy: NetworkPolicy, peers: tuple[Peer, ...]) -> str:
        """The name of the peers' set, made on first use; remembers the peer pods."""
        name = f"peers-{short_hash(_peers_key(policy, peers))}"
        if name not in self.out.peers:
            intervals: list[Interval] = []
            pods: list[Pod] = []
            for peer in peers:
                if peer.block is not None:
                    block = _intervals(peer.block, self.family)
                    intervals += block
                    pods += [
                        pod
                        for pod in self.cluster.pods.values()
                        if (a := self.address(pod)) is not None and _inside(a, block)
                    ]
                else:
                    pods += self._pods_of(policy, peer)
            for pod in pods:
                if (address := self.address(pod)) is not None:
                    value = int(ipaddress.ip_address(address))
                    intervals.append((value, value))
            self.out.peers[name] = merged(intervals)
            self._peer_pods[name] = pods
        return name

    def peer_port_set(self, peers: str | None, port: PortMatch, pods: Iterable[Pod]) -> str:
        """The name of the set of (address . protocol . port) of the named port on each peer
        pod (`peers` the peer set's name; None any pod)."""
        name = f"peer-ports-{short_hash(f'{peers}/{port.protocol}/{port.name}')}"
        if name in self.out.peer_ports:
            return name
        elements = set()
        for pod in pods:
            number = pod.port_named(port.name, port.protocol)
            address = self.address(pod)
            if number is not None and address is not None:
                elements.add((address, port.protocol.lower(), number))
        self.out.peer_ports[name] = frozenset(elements)
        return name

    def allows(self, policy: NetworkPolicy, direction: str, rule: Rule, pod: Pod) -> list[Allow]:
        peers = self.peer_set(policy, rule.peers) if rule.peers is not None else None
        if rule.ports is None:
            return [Allow(peers)]
        allows = []
        for port in rule.ports:
            protocol = port.protocol.lower()
            if port.name and direction == INGRESS:
                number = pod.port_named(port.name, port.protocol)
                if number is not None:
                    allows.append(Allow(peers, protocol, number, number))
            elif port.name:
                # egress: the name resolves on each destination pod among the peers
                candidates = (
                    self._peer_pods[peers] if peers is not None else self.cluster.pods.values()
                )
                allows.append(Allow(peer_ports=self.peer_port_set(peers, port, candidates)))
            elif port.number is not None:
                allows.append(Allow(peers, protocol, port.number, port.end or port.number))
            else:
                allows.append(Allow(peers, protocol))
        return allows

    def run(self) -> FamilyPolicy:
        local = [
            pod
            for pod in self.cluster.pods.values()
            if pod.node == self.cluster.node and self.address(pod) is not None
        ]
        self.out.local = frozenset(a for pod in local if (a := self.address(pod)) is not None)
        chains: dict[str, dict[Allow, None]] = {}
        policies = sorted(self.cluster.policies, key=lambda p: (p.namespace, p.name))
        for policy in policies:
            for pod in self.by_namespace.get(policy.namespace, []):
                if pod.node != self.cluster.node or not policy.pods.matches(pod.labels):
                    continue
                address = self.address(pod)
                if address is None:
                    continue
                for direction in sorted(policy.directions):
                    chain = chain_name(direction, (pod.namespace, pod.name))
                    allowed = chains.setdefault(chain, {})
                    self.out.owners[chain] = (pod.namespace, pod.name)
                    isolating = self.out.isolating.get(chain, ())
                    self.out.isolating[chain] = (*isolating, policy.name)
                    target = self.out.ingress if direction == INGRESS else self.out.egress
                    target[address] = chain
                    for rule in policy.rules(direction):
                        allowed.update(dict.fromkeys(self.allows(policy, direction, rule, pod)))
        self.out.chains = {chain: tuple(allowed) for chain, allowed in chains.items()}
        return self.out


def compile_family(cluster: Cluster, family: int) -> FamilyPolicy:
    return _Compiler(cluster, family).run()
