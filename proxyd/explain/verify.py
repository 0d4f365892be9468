"""Pure: what `kubectl knit explain --verify` probes, and whether the answers agree.

An explanation says, for each connection a new connection may become (one per eligible
endpoint, after the DNAT), whether the policies let it through. The probes ask the kernel
the same from the source pod itself (proxyd/explain/probe.py runs them):

- each endpoint's connection, to the endpoint's address and port directly: the policies judge
  it as they judge the DNAT'd one, since they see the connection after the DNAT. Not where the
  proxy masquerades it: a direct connection keeps the pod's address, which the ingress
  policies would judge instead of the node's;
- the Service's frontend, when every endpoint's connection has the same verdict (otherwise the
  proxy's choice of endpoint decides, and no single answer is expected); with no eligible
  endpoint, the frontend must not connect.

A probe that connects, or that the destination refuses (a TCP reset or an ICMP port
unreachable: the packet got there, and nothing listens), was let through; one that times
out was not: knit's policies drop what they deny.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxyd.explain.explain import Explanation

CONNECTED = "connected"
REFUSED = "refused"
TIMED_OUT = "timed out"
DELIVERED = (CONNECTED, REFUSED)
AGREES = "agrees"
DISAGREES = "disagrees"
INCONCLUSIVE = "inconclusive"


@dataclass(frozen=True)
class Probe:
    address: str
    port: int
    protocol: str
    target: str
    """What the address is, for the reader: an endpoint's pod, or the Service."""
    expected: bool
    """Whether the connection should get through."""


@dataclass(frozen=True)
class Answer:
    probe: Probe
    outcome: str
    """CONNECTED, REFUSED, TIMED_OUT, or the probe's own error."""

    @property
    def judgement(self) -> str:
        """AGREES, DISAGREES, or INCONCLUSIVE (the probe itself failed: no container, no
        agnhost, an address it cannot use)."""
        if self.outcome not in (*DELIVERED, TIMED_OUT):
            return INCONCLUSIVE
        return AGREES if (self.outcome in DELIVERED) == self.probe.expected else DISAGREES


@dataclass(frozen=True)
class Verification:
    pod: str
    """The source pod's ephemeral container that probed."""
    answers: tuple[Answer, ...]
    skipped: tuple[str, ...]
    """Connections not probed, and why."""

    @property
    def agrees(self) -> bool:
        return all(answer.judgement == AGREES for answer in self.answers)


def probes(explanation: Explanation) -> tuple[list[Probe], list[str]]:
    """The probes that test the explanation, and the connections left unprobed with why."""
    found: list[Probe] = []
    skipped: list[str] = []
    protocol = explanation.protocol
    for leg in explanation.legs:
        target = "/".join(leg.pod) if leg.pod else "not a pod"
        if leg.masquerade:
            skipped.append(
                f"{leg.address}:{leg.port}: masqueraded by the proxy, which a direct "
                "connection is not"
            )
            continue
        found.append(Probe(leg.address, leg.port, protocol, target, leg.allowed))
    service = explanation.service
    if service is None:
        return found, skipped
    frontend = f"Service {service.namespace}/{service.name}"
    verdicts = {leg.allowed for leg in explanation.legs}
    if len(verdicts) > 1:
        skipped.append(
            f"{service.address}:{service.port}: its endpoints' verdicts differ, so the "
            "proxy's choice decides"
        )
    else:
        expected = verdicts.pop() if verdicts else False
        found.append(Probe(service.address, service.port, protocol, frontend, expected))
    return found, skipped
