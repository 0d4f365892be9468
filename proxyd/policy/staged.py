"""Pure: what staged policies (model.STAGED_ANNOTATION) would do, beside what is enforced.

The compiler leaves staged policies out of the enforced table and compiles them, as if
enforced, only into the staged view (compile.FamilyCompiler's `staged_view`): the same
compile of every object, the staged ones included. A connection's staged decision is the
view's; it is worth showing where it differs from the enforced one, in verdict or in the rule
that decides, and since the staged policies are all that differs between the two compiles,
such a difference is theirs.

The kernel logs (flowlog.py) only the connections a pod chain judges, and a pod that only
staged policies select has no chain in the enforced table; `observed` gives such a pod, for
flow records, a chain that lets everything on, as the absence of a chain does, so that its
connections are logged and the view can judge them.
"""

from __future__ import annotations

import dataclasses

from proxyd.policy.compile import ALLOW, FamilyPolicy, PodChain
from proxyd.policy.decided import DecidedBy, rule_of


def changes(enforced: tuple[bool, DecidedBy], staged: tuple[bool, DecidedBy]) -> bool:
    """Whether the staged view's decision (allowed, what decided) differs from the enforced
    one: another verdict, or another policy rule (or isolation) deciding (a staged policy
    isolating a pod isolated already changes nothing)."""
    return enforced[0] != staged[0] or rule_of(enforced[1]) != rule_of(staged[1])


def observed(enforced: FamilyPolicy, view: FamilyPolicy) -> FamilyPolicy:
    """The enforced table, with a chain that only allows for each pod and direction that the
    staged view judges and the enforced table does not: the same verdicts, and a chain to
    log the pod's connections in. The enforced table itself when there is none to add.

    Such a chain has no rule, so it gives no pod `isolating` policies (the denied-packets
    metric and the log of denials name what drops, and it drops nothing)."""
    ingress = {a: chain for a, chain in view.ingress.items() if a not in enforced.ingress}
    egress = {a: chain for a, chain in view.egress.items() if a not in enforced.egress}
    if not ingress and not egress:
        return enforced
    added = {chain: PodChain((), ALLOW, chain) for chain in (*ingress.values(), *egress.values())}
    return dataclasses.replace(
        enforced,
        chains={**enforced.chains, **added},
        ingress={**enforced.ingress, **ingress},
        egress={**enforced.egress, **egress},
        owners={**enforced.owners, **{chain: view.owners[chain] for chain in added}},
    )
