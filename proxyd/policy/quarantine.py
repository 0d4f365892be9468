"""Pure: what nft refuses kept to the pods it belongs to.

When nft refuses a family's whole table, the enforcer looks for the pods whose chains make it
refuse (containment.refused: halving the node's pods over nft's dry runs). It then writes the
table with those pods quarantined: each of their chains drops everything in its direction,
under a comment of knit's own rather than the pod's name, and uses no peer set. A pod the
policies isolate so never opens because its rules could not be written, and the node's other
pods keep theirs.

A pod is named here by its first chain in a direction (a pod's chains share that chain's
counter), as the compiler names it.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from proxyd.policy.compile import DROP, FamilyPolicy, PodChain

QUARANTINED = "knit: quarantined, its rules were refused"
"""The comment of a quarantined pod's chain."""


def signature(policy: FamilyPolicy, pod: str) -> tuple[object, ...] | None:
    """The pod's chains (its first and the ones it goes on to) and owner as compiled; None
    when the policy has no chain of it. A quarantine holds while this stays the same: a pod
    whose rules changed has them tried again."""
    chains: list[object] = []
    name: str | None = pod
    while name is not None and (chain := policy.chains.get(name)) is not None:
        chains.append((name, chain))
        name = chain.next
    return (*chains, policy.owners.get(pod)) if chains else None


def _used_sets(chains: Collection[PodChain]) -> tuple[set[str], set[str]]:
    peers = {m.peers for c in chains for m in c.matches if m.peers is not None}
    peer_ports = {m.peer_ports for c in chains for m in c.matches if m.peer_ports is not None}
    return peers, peer_ports


def _with_chains(policy: FamilyPolicy, chains: dict[str, PodChain]) -> FamilyPolicy:
    """The policy holding only `chains`, the map entries that jump to them and the sets they
    use."""
    peers, peer_ports = _used_sets(chains.values())
    return replace(
        policy,
        chains=chains,
        ingress={a: c for a, c in policy.ingress.items() if c in chains},
        egress={a: c for a, c in policy.egress.items() if c in chains},
        peers={n: e for n, e in policy.peers.items() if n in peers},
        ranged=policy.ranged & peers,
        peer_ports={n: e for n, e in policy.peer_ports.items() if n in peer_ports},
        owners={c: o for c, o in policy.owners.items() if c in chains},
        isolating={c: p for c, p in policy.isolating.items() if c in chains},
        quarantined=policy.quarantined & chains.keys(),
    )


def subset(policy: FamilyPolicy, pods: Collection[str]) -> FamilyPolicy:
    """The table with only these pods' chains."""
    kept = set(pods)
    return _with_chains(policy, {name: c for name, c in policy.chains.items() if c.counter in kept})


def quarantined(policy: FamilyPolicy, pods: Collection[str]) -> FamilyPolicy:
    """The table with these pods' chains each replaced by one that drops everything."""
    if not pods:
        return policy
    chains = {}
    for name, chain in policy.chains.items():
        if chain.counter not in pods:
            chains[name] = chain
        elif name == chain.counter:
            chains[name] = PodChain((), DROP, name)
    held = replace(policy, quarantined=policy.quarantined | (frozenset(pods) & chains.keys()))
    return _with_chains(held, chains)
