"""Pure: explain a new connection from a pod, by the daemon's own code. The destination is
resolved as the proxy resolves it (proxyd/model.py, topology.py, port_plan.py): the Service
port, the endpoints eligible from the source's node and why the others are not, the DNAT and
whether the proxy masquerades. Each resulting connection is then judged as the two nodes'
policy tables judge it (proxyd/policy/compile.py compiled with provenance, verdict.Judge):
egress by the source's node, as the forward hook sees the packet after the DNAT, and ingress
by the destination's node.

A Service with several eligible endpoints is explained once per endpoint (or for the one
asked for): the proxy picks one per connection, and policies may judge them differently. The
explanation's verdict is a deny when any eligible endpoint is denied, since a new connection
may then be denied; the connection it shows first is the first denied one.

With staged policies, each connection is judged a second time by the staged view of the two
nodes' tables (the same compile, the staged policies in it as if enforced: staged.py); where
that changes a direction's verdict or deciding rule, the connection says what it would be.
The verdict stays the enforced one.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass, field

from proxyd.model import Endpoint, EndpointSlice, NodeInfo, ServicePort, endpoints_for, family_of
from proxyd.policy.cluster_model import ClusterNetworkPolicy
from proxyd.policy.compile import Cluster, PodKey, compile_family
from proxyd.policy.decided import DEFAULT, UNJUDGED, VERDICT_WORDS, DecidedBy, decided_by
from proxyd.policy.model import EGRESS, INGRESS, Namespace, NetworkPolicy, Pod
from proxyd.policy.staged import changes
from proxyd.policy.verdict import Connection, Judge
from proxyd.port_plan import FamilyContext, PortPlan, plan_port

CLUSTER_IP = "ClusterIP"
EXTERNAL_IP = "ExternalIP"
LOAD_BALANCER_IP = "LoadBalancerIP"


class ExplainError(ValueError):
    """The question cannot be answered as asked; the message says why."""


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    type: str
    ports: tuple[ServicePort, ...]


@dataclass(frozen=True)
class World:
    """The API objects explain reads, parsed by the daemon's parsers."""

    pods: Mapping[PodKey, Pod]
    """The pods of the pod network (model.parse_pod: no host-network or finished pod)."""
    namespaces: Mapping[str, Namespace]
    policies: tuple[NetworkPolicy, ...]
    cluster_policies: tuple[ClusterNetworkPolicy, ...]
    services: Mapping[tuple[str, str], Service]
    slices: Mapping[tuple[str, str], tuple[EndpointSlice, ...]]
    """(namespace, Service name) -> its EndpointSlices."""
    nodes: Mapping[str, NodeInfo]
    masquerade_all: bool = False
    """The daemons' --masquerade-all."""


@dataclass(frozen=True)
class PodTarget:
    namespace: str
    name: str


@dataclass(frozen=True)
class ServiceTarget:
    namespace: str
    name: str


@dataclass(frozen=True)
class AddressTarget:
    address: str


@dataclass(frozen=True)
class NamedTarget:
    """NS/NAME without a kind: the Service of that name if there is one, else the pod."""

    namespace: str
    name: str


ResolvedTarget = PodTarget | ServiceTarget | AddressTarget
Target = ResolvedTarget | NamedTarget


@dataclass(frozen=True)
class Question:
    source: PodKey
    target: Target
    port: int | str
    """A number, or a name: a Service port's name, or a named port of the destination pod."""
    protocol: str = "TCP"
    endpoint: str | None = None
    """Of a Service's eligible endpoints, explain only the one with this address."""


@dataclass(frozen=True)
class Hop:
    """One verdict met on a pod chain: the rule at `index` of the chain's rules as compiled
    (None: the chain's end)."""

    chain: str
    index: int | None
    verdict: str
    """allow, drop or pass."""
    decided_by: DecidedBy


@dataclass(frozen=True)
class Judgement:
    """One direction of one connection."""

    direction: str
    allowed: bool
    reached: bool
    """Whether the packet gets this far (ingress is not reached when egress drops it)."""
    decided_by: DecidedBy
    node: str | None = None
    """The node whose table judges."""
    pod: PodKey | None = None
    """The pod whose chains judge (the sender's for egress, the receiver's for ingress)."""
    judged_by: tuple[str, ...] = ()
    """The policies that select that pod in this direction, cluster policies by name."""
    isolated_by: tuple[str, ...] = ()
    """The NetworkPolicies among them, which isolate the pod in this direction."""
    path: tuple[Hop, ...] = ()


@dataclass(frozen=True)
class StagedLeg:
    """What the staged policies would make of one connection: both directions as the staged
    view judges them, and the directions whose verdict or deciding rule that changes."""

    egress: Judgement
    ingress: Judgement
    changed: tuple[str, ...]
    """EGRESS, INGRESS, or both."""

    @property
    def allowed(self) -> bool:
        return self.egress.allowed and self.ingress.allowed


@dataclass(frozen=True)
class Leg:
    """One connection as the forward hook sees it: to one endpoint, after the DNAT."""

    address: str
    port: int
    pod: PodKey | None
    node: str | None
    masquerade: bool
    masquerade_reason: str
    egress: Judgement
    ingress: Judgement
    staged: StagedLeg | None = None
    """Where staged policies would change a direction's verdict or deciding rule."""

    @property
    def allowed(self) -> bool:
        return self.egress.allowed and self.ingress.allowed

    @property
    def would_allow(self) -> bool:
        """The verdict with the staged policies enforced."""
        return self.staged.allowed if self.staged is not None else self.allowed


@dataclass(frozen=True)
class EndpointChoice:
    address: str
    port: int
    node: str
    pod: PodKey | None
    eligible: bool
    reason: str


@dataclass(frozen=True)
class ServicePath:
    """The Service a destination resolved to, and what the proxy does with it."""

    namespace: str
    name: str
    type: str
    port_name: str
    frontend: str
    """ClusterIP, ExternalIP or LoadBalancerIP."""
    address: str
    port: int
    internal_traffic_policy: str
    external_traffic_policy: str
    endpoints: tuple[EndpointChoice, ...]
    no_endpoint: str | None
    """When no endpoint is eligible, what the proxy does with a new connection (reject, or
    drop where only a Local policy finds none) and why."""


@dataclass(frozen=True)
class Explanation:
    source: PodKey
    source_node: str
    source_address: str
    protocol: str
    destination: str
    """What was asked, resolved: Pod, Service or Address."""
    address: str
    port: int
    destination_pod: PodKey | None
    service: ServicePath | None
    legs: tuple[Leg, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def allowed(self) -> bool:
        return bool(self.legs) and all(leg.allowed for leg in self.legs)

    @property
    def shown(self) -> Leg | None:
        """The connection shown first: the first denied one, else the first."""
        return next(
            (leg for leg in self.legs if not leg.allowed), self.legs[0] if self.legs else None
        )

    @property
    def would_allow(self) -> bool:
        """The verdict with the staged policies enforced."""
        return bool(self.legs) and all(leg.would_allow for leg in self.legs)

    @property
    def staged_shown(self) -> StagedLeg | None:
        """What the staged policies change, shown first: of the connections they change, the
        first they would deny, else the first; None when they change none."""
        changed = [leg.staged for leg in self.legs if leg.staged is not None]
        return next((s for s in changed if not s.allowed), changed[0] if changed else None)


class Explainer:
    """Answers questions about one World; each node's compiled tables are kept for the
    next question."""

    def __init__(self, world: World) -> None:
        self.world = world
        self._judges: dict[tuple[str, int, bool], Judge] = {}
        self._by_address: dict[int, Pod] = {
            number: pod for pod in world.pods.values() for number in pod.numbers
        }
        self.has_staged = any(p.staged for p in world.policies) or any(
            p.staged for p in world.cluster_policies
        )
        """Whether a policy is staged: connections are then judged by the staged view too."""

    def judge(self, node: str, family: int, staged_view: bool = False) -> Judge:
        """The node's policy table of the family, compiled as its daemon compiles it, or its
        staged view (`staged_view`)."""
        key = (node, family, staged_view)
        if key not in self._judges:
            world = self.world
            cluster = Cluster.of(
                node, world.pods, world.namespaces, world.policies, world.cluster_policies
            )
            compiled = compile_family(cluster, family, provenance=True, staged_view=staged_view)
            self._judges[key] = Judge(compiled)
        return self._judges[key]

    def explain(self, question: Question) -> Explanation:
        source = self.world.pods.get(question.source)
        if source is None:
            raise ExplainError(
                f"no pod {'/'.join(question.source)} in the pod network (absent, host-network, "
                "finished, or without an address yet)"
            )
        protocol = question.protocol.upper()
        target: ResolvedTarget
        notes: tuple[str, ...] = ()
        if isinstance(question.target, NamedTarget):
            key = (question.target.namespace, question.target.name)
            if key not in self.world.services:
                target = PodTarget(*key)
            else:
                target = ServiceTarget(*key)
                if key in self.world.pods:
                    notes = (f"a pod {'/'.join(key)} exists too: pod/{'/'.join(key)} names it",)
        elif isinstance(question.target, AddressTarget):
            target = self._what_is(question.target.address, question.port, protocol)
        else:
            target = question.target
        explanation = self._resolved(source, target, question, protocol)
        return dataclasses.replace(explanation, notes=notes + explanation.notes)

    def _resolved(
        self, source: Pod, target: ResolvedTarget, question: Question, protocol: str
    ) -> Explanation:
        if isinstance(target, ServiceTarget):
            return self._to_service(source, target, question, protocol)
        if isinstance(target, PodTarget):
            pod = self.world.pods.get((target.namespace, target.name))
            if pod is None:
                raise ExplainError(
                    f"no pod {target.namespace}/{target.name} in the pod network (absent, "
                    "host-network, finished, or without an address yet)"
                )
            family = next((f for f in source.by_family if f in pod.by_family), None)
            if family is None:
                raise ExplainError(
                    f"{target.namespace}/{target.name} has no address of a family the source has"
                )
            port = self._pod_port(pod, question.port, protocol)
            address = pod.by_family[family][0]
            return self._direct(source, "Pod", address, port, protocol, (pod.namespace, pod.name))
        address = target.address
        if not isinstance(question.port, int):
            raise ExplainError(f"a named port ({question.port}) needs a pod or Service to name it")
        if family_of(address) not in source.by_family:
            raise ExplainError(f"the source has no IPv{family_of(address)} address")
        notes: tuple[str, ...] = ()
        if address in self._node(source.node).addresses:
            notes = ("the source's own node: a pod's traffic to its node is never judged",)
        elif any(address in node.addresses for node in self.world.nodes.values()):
            notes = (
                "a node's address: NodePorts are not followed, the traffic is judged as "
                "sent to that address",
            )
        return self._direct(source, "Address", address, question.port, protocol, None, notes)

    def _direct(
        self,
        source: Pod,
        kind: str,
        address: str,
        port: int,
        protocol: str,
        pod: PodKey | None,
        notes: tuple[str, ...] = (),
    ) -> Explanation:
        """A connection to a pod or an address: no proxy between."""
        leg = self._leg(source, address, port, protocol, False, "")
        source_address = source.by_family[family_of(address)][0]
        return Explanation(
            (source.namespace, source.name), source.node, source_address, protocol, kind,
            address, port, pod, None, (leg,), notes,
        )  # fmt: skip

    # ------------------------------------------------------------ the destination

    def _node(self, name: str) -> NodeInfo:
        return self.world.nodes.get(name) or NodeInfo(name)

    def _what_is(self, address: str, port: int | str, protocol: str) -> ResolvedTarget:
        """An address as the source's node sees it: a Service frontend on that port, a pod,
        or just an address."""
        try:
            number = int(ipaddress.ip_address(address))
        except ValueError as err:
            raise ExplainError(f"{address!r} is not an IP address") from err
        text = str(ipaddress.ip_address(address))
        for service in self.world.services.values():
            for service_port in service.ports:
                frontends = (
                    *service_port.cluster_ips,
                    *service_port.external_ips,
                    *service_port.load_balancer_ips,
                )
                if (
                    text in frontends
                    and service_port.port == port
                    and service_port.protocol == protocol
                ):
                    return ServiceTarget(service.namespace, service.name)
        pod = self._by_address.get(number)
        if pod is not None:
            return PodTarget(pod.namespace, pod.name)
        return AddressTarget(text)

    def _pod_port(self, pod: Pod, port: int | str, protocol: str) -> int:
        if isinstance(port, int):
            return port
        number = pod.port_named(port, protocol)
        if number is None:
            raise ExplainError(f"{pod.namespace}/{pod.name} has no {protocol} port named {port!r}")
        return number

    def _to_service(
        self, source: Pod, target: ServiceTarget, question: Question, protocol: str
    ) -> Explanation:
        service = self.world.services.get((target.namespace, target.name))
        if service is None:
            raise ExplainError(
                f"no Service {target.namespace}/{target.name} with a cluster IP (absent, "
                "headless, ExternalName, or another proxy's)"
            )
        port = next(
            (
                p
                for p in service.ports
                if p.protocol == protocol and question.port in (p.port, p.name.port)
            ),
            None,
        )
        if port is None:
            raise ExplainError(
                f"Service {target.namespace}/{target.name} has no {protocol} port {question.port!r}"
            )
        frontend, address = self._frontend(source, port, question.target)
        family = family_of(address)
        endpoints = endpoints_for(
            port, list(self.world.slices.get((target.namespace, target.name), ()))
        )
        context = FamilyContext(
            family, self._node(source.node), masquerade_all=self.world.masquerade_all
        )
        plan = plan_port(port, endpoints, context)
        assert plan is not None, "the frontend is of the family"
        chosen = plan.internal_endpoints if frontend == CLUSTER_IP else plan.cluster
        in_family = [e for e in endpoints if family_of(e.ip) == family]
        choices = tuple(
            EndpointChoice(
                e.ip,
                e.port,
                e.node_name,
                self._pod_at(e.ip),
                e in chosen,
                _chosen(e) if e in chosen else _not_chosen(e, plan, frontend, context.node),
            )
            for e in in_family
        )
        no_endpoint = None
        if not chosen:
            no_endpoint = (
                "drop: internalTrafficPolicy Local and no endpoint on the source's node"
                if frontend == CLUSTER_IP and plan.no_local_internal
                else "reject: no usable endpoint"
            )
        picked = list(chosen)
        if question.endpoint is not None:
            picked = [e for e in chosen if e.ip == str(ipaddress.ip_address(question.endpoint))]
            if not picked:
                raise ExplainError(
                    f"{question.endpoint} is not an eligible endpoint of "
                    f"{target.namespace}/{target.name}"
                )
        legs = []
        for endpoint in picked:
            masquerade, why = self._masquerade(source, endpoint, port, frontend)
            legs.append(self._leg(source, endpoint.ip, endpoint.port, protocol, masquerade, why))
        path = ServicePath(
            service.namespace,
            service.name,
            service.type,
            port.name.port,
            frontend,
            address,
            port.port,
            "Local" if port.internal_policy_local else "Cluster",
            "Local" if port.external_policy_local else "Cluster",
            choices,
            no_endpoint,
        )
        return Explanation(
            (source.namespace, source.name),
            source.node,
            source.by_family[family][0],
            protocol,
            "Service",
            address,
            port.port,
            None,
            path,
            tuple(legs),
        )

    def _frontend(self, source: Pod, port: ServicePort, target: Target) -> tuple[str, str]:
        """Which frontend the connection goes to: the address asked for, or the cluster IP of
        the first family the source has an address of."""
        if isinstance(target, AddressTarget):
            text = str(ipaddress.ip_address(target.address))
            if text in port.cluster_ips:
                return CLUSTER_IP, text
            return (EXTERNAL_IP if text in port.external_ips else LOAD_BALANCER_IP), text
        for address in port.cluster_ips:
            if family_of(address) in source.by_family:
                return CLUSTER_IP, address
        raise ExplainError(f"{port.name} has no cluster IP of a family the source has")

    def _pod_at(self, address: str) -> PodKey | None:
        pod = self._by_address.get(int(ipaddress.ip_address(address)))
        return (pod.namespace, pod.name) if pod is not None else None

    def _masquerade(
        self, source: Pod, endpoint: Endpoint, port: ServicePort, frontend: str
    ) -> tuple[bool, str]:
        """Whether the proxy masquerades the connection, as its rules decide (each mode's
        render): after the policy's forward hook on the source's node."""
        if endpoint.ip in source.addresses:
            return True, "hairpin: the endpoint is the source itself"
        if self.world.masquerade_all:
            return True, "masqueradeAll"
        if frontend == CLUSTER_IP:
            return False, "the source is a pod, inside the cluster CIDR"
        if port.external_policy_local:
            return False, "externalTrafficPolicy Local: a pod's connection keeps its address"
        return True, "externalTrafficPolicy Cluster"

    # ------------------------------------------------------------ the policies

    def _leg(
        self, source: Pod, address: str, port: int, protocol: str, masquerade: bool, why: str
    ) -> Leg:
        """The connection judged by the nodes' tables, and by their staged views where a
        policy is staged."""
        leg = self._judged(source, address, port, protocol, masquerade, why, False)
        if not self.has_staged:
            return leg
        would = self._judged(source, address, port, protocol, masquerade, why, True)
        changed = tuple(
            was.direction
            for was, now in ((leg.egress, would.egress), (leg.ingress, would.ingress))
            if changes((was.allowed, was.decided_by), (now.allowed, now.decided_by))
        )
        if not changed:
            return leg
        return dataclasses.replace(leg, staged=StagedLeg(would.egress, would.ingress, changed))

    def _judged(
        self,
        source: Pod,
        address: str,
        port: int,
        protocol: str,
        masquerade: bool,
        why: str,
        staged_view: bool,
    ) -> Leg:
        family = family_of(address)
        source_address = source.by_family[family][0]
        destination = self._by_address.get(int(ipaddress.ip_address(address)))
        node = destination.node if destination is not None else None
        key = (destination.namespace, destination.name) if destination is not None else None
        connection = Connection(source_address, address, protocol.lower(), port)
        if destination is not None and (destination.namespace, destination.name) == (
            source.namespace,
            source.name,
        ):
            itself = DecidedBy(UNJUDGED, "a pod's traffic to itself is always allowed")
            both = Judgement(EGRESS, True, True, itself), Judgement(INGRESS, True, True, itself)
            return Leg(address, port, key, node, masquerade, why, *both)
        if address in self._node(source.node).addresses:
            unjudged = DecidedBy(UNJUDGED, "to the source's own node: never judged by policy")
            egress = Judgement(EGRESS, True, True, unjudged)
        else:
            egress = self._judgement(EGRESS, source, source.node, connection, True, staged_view)
        if destination is None:
            ingress = Judgement(
                INGRESS,
                True,
                egress.allowed,
                DecidedBy(
                    UNJUDGED, "not a pod of the pod network: no ingress policy of knit's applies"
                ),
            )
        else:
            if masquerade and destination.node != source.node:
                # the masquerade of the source's node comes before the destination's node
                # judges, so that node's policies see the source node's address
                node_address = next(
                    (a for a in self._node(source.node).addresses if family_of(a) == family), None
                )
                if node_address is None:
                    raise ExplainError(
                        f"masqueraded by node {source.node}, whose IPv{family} address is unknown"
                    )
                connection = Connection(node_address, address, protocol.lower(), port)
            ingress = self._judgement(
                INGRESS, destination, destination.node, connection, egress.allowed, staged_view
            )
        return Leg(address, port, key, node, masquerade, why, egress, ingress)

    def _judgement(
        self,
        direction: str,
        pod: Pod,
        node: str,
        connection: Connection,
        reached: bool,
        staged_view: bool,
    ) -> Judgement:
        judge = self.judge(node, family_of(connection.destination), staged_view)
        decision = judge.decide(direction, connection)
        key = (pod.namespace, pod.name)
        if decision is None:
            default = DecidedBy(
                DEFAULT, f"no policy selects {'/'.join(key)} for {direction.lower()}: not isolated"
            )
            return Judgement(direction, True, reached, default, node, key)
        first = decision.path[0].chain
        hops = tuple(
            Hop(
                step.chain,
                step.index,
                VERDICT_WORDS[step.verdict],
                decided_by(step, judge.policy, direction),
            )
            for step in decision.path
        )
        return Judgement(
            direction,
            decision.allowed,
            reached,
            hops[-1].decided_by,
            node,
            key,
            judge.policy.isolating.get(first, ()),
            judge.policy.isolated_by.get(first, ()),
            hops,
        )


def _chosen(endpoint: Endpoint) -> str:
    if not endpoint.ready:
        return "serving and terminating, used because no endpoint is ready"
    return "ready"


def _not_chosen(endpoint: Endpoint, plan: PortPlan, frontend: str, node: NodeInfo) -> str:
    """Why the proxy of the source's node does not send to the endpoint (topology.py)."""
    local = plan.port.internal_policy_local if frontend == CLUSTER_IP else False
    if local and endpoint.node_name != node.name:
        return (
            f"internalTrafficPolicy Local: on node {endpoint.node_name or '?'}, not the "
            f"source's node {node.name}"
        )
    if not endpoint.ready and not (endpoint.serving and endpoint.terminating):
        return "not ready" + (" (terminating)" if endpoint.terminating else "")
    if not endpoint.ready:
        return "terminating: ready endpoints exist"
    hints = sorted(endpoint.node_hints) or sorted(endpoint.zone_hints)
    if hints:
        kind = "nodes" if endpoint.node_hints else "zones"
        return (
            f"topology hints: for {kind} {', '.join(hints)}, not the source's node "
            f"{node.name} (zone {node.zone or '?'})"
        )
    return "not chosen by the proxy"
