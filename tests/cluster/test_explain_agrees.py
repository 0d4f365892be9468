"""`kubectl knit explain` against the packets (proxyd/explain): does explain's verdict equal
what the kernel does, for every pair of pods, port and protocol?

Pods a, b and c in each of three namespaces, a on node1, b on node2 and c on node3, each serving
TCP and UDP on ports 80 and 81 under named ports (serve-80-tcp ...), as the upstream Netpol e2e
specs' model does. Each scenario below is a set of NetworkPolicies and ClusterNetworkPolicies
modelled on those specs and on network-policy-api's conformance tests. For each, every pod
probes every other pod's IPv4 address on each port and protocol, and explain answers the same
question from the API objects with the daemon's own compiler. The probes are repeated until
they agree or AGREE_WITHIN passes, since the daemons program a change a moment after the API
has it; what still disagrees then is listed per scenario.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest

from deploy.lab.churn import AGNHOST
from deploy.lab.lab import KUBECTL, Lab
from deploy.lab.netns import unique_name
from deploy.lab.process import eventually
from proxyd.explain import cli
from proxyd.explain.cli import fetch_world, lister
from proxyd.explain.explain import AddressTarget, Explainer, Explanation, Question

PODS = ("a", "b", "c")
PORTS = (80, 81)
PROTOCOLS = ("TCP", "UDP")
AGREE_WITHIN = 30.0
CLUSTER_POLICIES = "clusternetworkpolicies.policy.networking.k8s.io"
STAGED = "NetworkPolicy, staged: deny all ingress"
FLOW_RECORDS = "--flow-records-rate=1000"
"""What --verify's test runs the daemons with, to check the deciding rule too (the
recommended rate: docs/observability.md)."""
# every target given as ADDRESS PORT PROTOCOL probed at once from the pod it runs in: a TCP
# connection or a UDP exchange with netexec's `hostname` command, one second each
PROBE = r"""
probe() {
    if [ "$3" = TCP ]; then nc -z -w 1 "$1" "$2" 2>/dev/null && echo "$1 $2 $3 yes" && return
    elif [ -n "$(echo hostname | nc -u -w 1 "$1" "$2" 2>/dev/null)" ]; then
        echo "$1 $2 $3 yes"; return
    fi
    echo "$1 $2 $3 no"
}
while [ $# -ge 3 ]; do probe "$1" "$2" "$3" & shift 3; done
wait
"""

Probe = tuple[str, str, str, int, str]
"""(source namespace/pod, target namespace/pod, target address, port, protocol)"""


@dataclass(frozen=True)
class Names:
    """The three namespaces' real names, under the scenarios' short ones (x, y, z)."""

    x: str
    y: str
    z: str

    def __getitem__(self, short: str) -> str:
        return str(getattr(self, short))


@dataclass
class Matrix:
    names: Names
    addresses: dict[str, str]
    """namespace/pod -> its IPv4 address"""


def _pod(namespace: str, name: str, node: str) -> dict[str, Any]:
    def server(port: int) -> dict[str, Any]:
        return {
            "name": f"serve-{port}",
            "image": AGNHOST,
            "args": ["netexec", f"--http-port={port}", f"--udp-port={port}"],
            "ports": [
                {"name": f"serve-{port}-tcp", "containerPort": port, "protocol": "TCP"},
                {"name": f"serve-{port}-udp", "containerPort": port, "protocol": "UDP"},
            ],
        }

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": {"pod": name}},
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 1,
            "containers": [server(port) for port in PORTS],
        },
    }


def _apply(lab: Lab, objects: list[dict[str, Any]]) -> None:
    path = f"/tmp/{unique_name('explain-agrees')}.json"
    with open(path, "w") as out:
        json.dump({"apiVersion": "v1", "kind": "List", "items": objects}, out)
    try:
        lab.kubectl("apply", "-f", path)
    finally:
        os.unlink(path)


@pytest.fixture(scope="module")
def matrix(lab: Lab) -> Iterator[Matrix]:
    base = unique_name("agree")
    names = Names(f"{base}-x", f"{base}-y", f"{base}-z")
    nodes = sorted(lab.nodes)
    objects: list[dict[str, Any]] = []
    for namespace in (names.x, names.y, names.z):
        objects.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        objects += [_pod(namespace, pod, nodes[i % len(nodes)]) for i, pod in enumerate(PODS)]
    try:
        _apply(lab, objects)
        addresses = {}
        for namespace in (names.x, names.y, names.z):
            lab.kubectl(
                "-n", namespace, "wait", "--for=condition=Ready", "pods", "--all",
                "--timeout=180s", timeout=200,
            )  # fmt: skip
            listed = json.loads(lab.kubectl("-n", namespace, "get", "pods", "-o", "json"))
            for pod in listed["items"]:
                v4 = [
                    ip["ip"]
                    for ip in pod["status"]["podIPs"]
                    if ipaddress.ip_address(ip["ip"]).version == 4
                ]
                addresses[f"{namespace}/{pod['metadata']['name']}"] = v4[0]
        yield Matrix(names, addresses)
    finally:
        lab.kubectl(
            "delete", "namespace", names.x, names.y, names.z, "--wait=false",
            "--ignore-not-found",
        )  # fmt: skip


# ---------------------------------------------------------------- the scenarios' objects


def _by_name(namespace: str) -> dict[str, Any]:
    return {"matchLabels": {"kubernetes.io/metadata.name": namespace}}


def netpol(namespace: str, name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"podSelector": {}, **spec},
    }


def cnp(name: str, tier: str, priority: int, subject: str, **rules: Any) -> dict[str, Any]:
    return {
        "apiVersion": "policy.networking.k8s.io/v1alpha2",
        "kind": "ClusterNetworkPolicy",
        "metadata": {"name": name},
        "spec": {
            "tier": tier,
            "priority": priority,
            "subject": {"namespaces": _by_name(subject)},
            **rules,
        },
    }


Scenario = Callable[[Names, dict[str, str], str], list[dict[str, Any]]]
"""(namespaces, addresses, a unique prefix for cluster-wide names) -> the scenario's objects"""


def _no_policy(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    return []


def _deny_all_ingress(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    return [netpol(n.x, "deny-ingress", policyTypes=["Ingress"])]


def _staged_deny_all_ingress(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    staged = netpol(n.x, "staged-deny-ingress", policyTypes=["Ingress"])
    staged["metadata"]["annotations"] = {"knit.dev/staged": "true"}
    return [staged]


def _ingress_from_namespace(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    peer = {"namespaceSelector": _by_name(n.y)}
    return [netpol(n.x, "from-y", podSelector={"matchLabels": {"pod": "a"}},
                   ingress=[{"from": [peer]}])]  # fmt: skip


def _ingress_from_pod_on_a_port(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    peer = {"podSelector": {"matchLabels": {"pod": "b"}}}
    rule = {"from": [peer], "ports": [{"port": 80, "protocol": "TCP"}]}
    return [netpol(n.x, "b-on-80", ingress=[rule])]


def _ingress_on_a_named_port(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    rule = {"ports": [{"port": "serve-81-udp", "protocol": "UDP"}]}
    return [netpol(n.x, "named-81-udp", ingress=[rule])]


def _deny_all_egress(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    return [netpol(n.y, "deny-egress", podSelector={"matchLabels": {"pod": "a"}},
                   policyTypes=["Egress"])]  # fmt: skip


def _egress_to_namespace_on_a_port(
    n: Names, ips: dict[str, str], prefix: str
) -> list[dict[str, Any]]:
    rule = {"to": [{"namespaceSelector": _by_name(n.z)}], "ports": [{"port": 81}]}
    return [netpol(n.y, "to-z-81", policyTypes=["Egress"], egress=[rule])]


def _ingress_from_a_block_with_an_exception(
    n: Names, ips: dict[str, str], prefix: str
) -> list[dict[str, Any]]:
    block = {"cidr": "0.0.0.0/0", "except": [f"{ips[f'{n.y}/c']}/32"]}
    return [netpol(n.x, "all-but-yc", ingress=[{"from": [{"ipBlock": block}]}])]


def _admin_deny(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    rule = {"action": "Deny", "from": [{"namespaces": _by_name(n.y)}]}
    return [cnp(f"{prefix}-deny-y", "Admin", 10, n.x, ingress=[rule])]


def _admin_accept_over_networkpolicy(
    n: Names, ips: dict[str, str], prefix: str
) -> list[dict[str, Any]]:
    rule = {"action": "Accept", "from": [{"namespaces": _by_name(n.z)}]}
    return [
        netpol(n.x, "deny-ingress", policyTypes=["Ingress"]),
        cnp(f"{prefix}-accept-z", "Admin", 10, n.x, ingress=[rule]),
    ]


def _admin_pass_then_baseline(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    passed = {"action": "Pass", "from": [{"namespaces": _by_name(n.y)}]}
    denied = {"action": "Deny", "from": [{"namespaces": _by_name(n.y)}]}
    tcp_81 = {"action": "Deny", "protocols": [{"tcp": {"destinationPort": {"number": 81}}}],
              "from": [{"namespaces": _by_name(n.z)}]}  # fmt: skip
    return [
        cnp(f"{prefix}-pass-y", "Admin", 10, n.x, ingress=[passed]),
        cnp(f"{prefix}-baseline", "Baseline", 10, n.x, ingress=[denied, tcp_81]),
    ]


def _admin_egress_deny(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    rule = {"action": "Deny", "to": [{"namespaces": _by_name(n.x)}],
            "protocols": [{"udp": {"destinationPort": {"number": 80}}}]}  # fmt: skip
    return [cnp(f"{prefix}-no-udp-80", "Admin", 20, n.z, egress=[rule])]


def _deny_all_both_ways(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    return [netpol(n.x, "deny-all", policyTypes=["Ingress", "Egress"])]


def _ingress_by_namespace_expression(
    n: Names, ips: dict[str, str], prefix: str
) -> list[dict[str, Any]]:
    outside_x = {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": [n.x]},
    ]}  # fmt: skip
    return [netpol(n.x, "not-from-x", ingress=[{"from": [{"namespaceSelector": outside_x}]}])]


def _ingress_from_pod_and_namespace(
    n: Names, ips: dict[str, str], prefix: str
) -> list[dict[str, Any]]:
    # one peer: pod b of namespace y, or c of any namespace but x (an AND in each peer)
    b_in_y = {"podSelector": {"matchLabels": {"pod": "b"}}, "namespaceSelector": _by_name(n.y)}
    c_anywhere = {
        "podSelector": {"matchExpressions": [{"key": "pod", "operator": "In", "values": ["c"]}]},
        "namespaceSelector": {},
    }
    return [netpol(n.x, "b-in-y-or-c", podSelector={"matchLabels": {"pod": "a"}},
                   ingress=[{"from": [b_in_y, c_anywhere]}])]  # fmt: skip


def _ingress_from_own_namespace_only(
    n: Names, ips: dict[str, str], prefix: str
) -> list[dict[str, Any]]:
    return [netpol(n.z, "own-namespace", ingress=[{"from": [{"podSelector": {}}]}])]


def _stacked_policies(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    # two policies over overlapping pods: their allows add up
    return [
        netpol(n.x, "y-to-80", ingress=[{"from": [{"namespaceSelector": _by_name(n.y)}],
                                         "ports": [{"port": 80, "protocol": "TCP"}]}]),
        netpol(n.x, "z-to-a-81", podSelector={"matchLabels": {"pod": "a"}},
               ingress=[{"from": [{"namespaceSelector": _by_name(n.z)}],
                         "ports": [{"port": 81, "protocol": "UDP"}]}]),
    ]  # fmt: skip


def _ingress_on_one_protocol(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    return [netpol(n.y, "udp-only", ingress=[{"ports": [{"protocol": "UDP"}]}])]


def _ingress_on_a_port_range(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    ports = [{"port": 81, "endPort": 90, "protocol": "TCP"}]
    return [netpol(n.y, "range-81-90", ingress=[{"ports": ports}])]


def _egress_on_a_named_port(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    ports = [{"port": "serve-80-tcp", "protocol": "TCP"}]
    return [netpol(n.z, "named-80-out", policyTypes=["Egress"], egress=[{"ports": ports}])]


def _egress_to_a_block_with_an_exception(
    n: Names, ips: dict[str, str], prefix: str
) -> list[dict[str, Any]]:
    around_xa = ipaddress.ip_network(f"{ips[f'{n.x}/a']}/16", strict=False)
    block = {"cidr": str(around_xa), "except": [f"{ips[f'{n.x}/b']}/32"]}
    return [netpol(n.y, "out-but-xb", policyTypes=["Egress"],
                   egress=[{"to": [{"ipBlock": block}]}])]  # fmt: skip


def _client_egress_deny_beats_server_allow(
    n: Names, ips: dict[str, str], prefix: str
) -> list[dict[str, Any]]:
    return [
        netpol(n.y, "no-egress", podSelector={"matchLabels": {"pod": "b"}},
               policyTypes=["Egress"]),
        netpol(n.x, "allow-all-in", ingress=[{}]),
    ]  # fmt: skip


def _admin_priorities(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    # the lower priority number wins: accept y on port 80 before denying all of y
    accept_80 = {"action": "Accept", "from": [{"namespaces": _by_name(n.y)}],
                 "protocols": [{"tcp": {"destinationPort": {"number": 80}}}]}  # fmt: skip
    deny = {"action": "Deny", "from": [{"namespaces": _by_name(n.y)}]}
    return [
        cnp(f"{prefix}-deny-y", "Admin", 30, n.z, ingress=[deny]),
        cnp(f"{prefix}-accept-y-80", "Admin", 5, n.z, ingress=[accept_80]),
    ]


def _pods_peer_and_baseline(n: Names, ips: dict[str, str], prefix: str) -> list[dict[str, Any]]:
    # an Admin deny of pod c of any namespace; a Baseline accept does not undo a
    # NetworkPolicy's isolation, which denies the rest of x
    pods_c = {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"pod": "c"}}}}
    return [
        cnp(f"{prefix}-no-c", "Admin", 15, n.y, ingress=[{"action": "Deny", "from": [pods_c]}]),
        cnp(f"{prefix}-baseline-x", "Baseline", 15, n.x,
            ingress=[{"action": "Accept", "from": [{"namespaces": _by_name(n.z)}]}]),
        netpol(n.x, "from-y-only", ingress=[{"from": [{"namespaceSelector": _by_name(n.y)}]}]),
    ]  # fmt: skip


SCENARIOS: dict[str, Scenario] = {
    "no policy": _no_policy,
    "NetworkPolicy: deny all ingress": _deny_all_ingress,
    STAGED: _staged_deny_all_ingress,
    "NetworkPolicy: ingress from a namespace": _ingress_from_namespace,
    "NetworkPolicy: ingress from a pod on a port": _ingress_from_pod_on_a_port,
    "NetworkPolicy: ingress on a named port": _ingress_on_a_named_port,
    "NetworkPolicy: deny all egress": _deny_all_egress,
    "NetworkPolicy: egress to a namespace on a port": _egress_to_namespace_on_a_port,
    "NetworkPolicy: ipBlock with an exception": _ingress_from_a_block_with_an_exception,
    "ClusterNetworkPolicy: Admin deny": _admin_deny,
    "ClusterNetworkPolicy: Admin accept over a NetworkPolicy": _admin_accept_over_networkpolicy,
    "ClusterNetworkPolicy: Admin pass, then Baseline": _admin_pass_then_baseline,
    "ClusterNetworkPolicy: Admin egress deny by protocol and port": _admin_egress_deny,
    "NetworkPolicy: deny all ingress and egress": _deny_all_both_ways,
    "NetworkPolicy: ingress by a namespace expression": _ingress_by_namespace_expression,
    "NetworkPolicy: ingress from pod AND namespace peers": _ingress_from_pod_and_namespace,
    "NetworkPolicy: ingress from its own namespace only": _ingress_from_own_namespace_only,
    "NetworkPolicy: stacked policies add up": _stacked_policies,
    "NetworkPolicy: ingress on one protocol, any port": _ingress_on_one_protocol,
    "NetworkPolicy: ingress on a port range": _ingress_on_a_port_range,
    "NetworkPolicy: egress on a named port": _egress_on_a_named_port,
    "NetworkPolicy: egress to ipBlock with an exception": _egress_to_a_block_with_an_exception,
    "NetworkPolicy: client egress deny over server allow": _client_egress_deny_beats_server_allow,
    "ClusterNetworkPolicy: Admin priorities": _admin_priorities,
    "ClusterNetworkPolicy: pods peer, Baseline under isolation": _pods_peer_and_baseline,
}


# ---------------------------------------------------------------- probes and answers


def _probes(matrix: Matrix) -> list[Probe]:
    return [
        (source, target, address, port, protocol)
        for source in matrix.addresses
        for target, address in matrix.addresses.items()
        if target != source  # a pod's own traffic never leaves it: policies do not see it
        for port in PORTS
        for protocol in PROTOCOLS
    ]


def observed(lab: Lab, probes: list[Probe]) -> dict[Probe, bool]:
    """Each probe's outcome by packets: one exec per source pod, its probes in parallel."""
    by_source: dict[str, list[Probe]] = {}
    for probe in probes:
        by_source.setdefault(probe[0], []).append(probe)

    def run(source: str, own: list[Probe]) -> dict[Probe, bool]:
        namespace, pod = source.split("/")
        argv = [str(part) for _, _, address, port, proto in own for part in (address, port, proto)]
        printed = lab.kubectl(
            "-n", namespace, "exec", pod, "-c", "serve-80", "--", "sh", "-c", PROBE, "sh", *argv,
            timeout=60,
        )  # fmt: skip
        answers = {
            tuple(line.split()[:3]): line.split()[3] == "yes" for line in printed.splitlines()
        }
        return {probe: answers[(probe[2], str(probe[3]), probe[4])] for probe in own}

    with ThreadPoolExecutor(len(by_source)) as pool:
        results = pool.map(lambda item: run(*item), by_source.items())
        return {probe: allowed for result in results for probe, allowed in result.items()}


def explained(lab: Lab, probes: list[Probe]) -> dict[Probe, Explanation]:
    """Each probe explained, from one reading of the API objects."""
    explainer = Explainer(fetch_world(lister(str(lab.kubeconfig)), masquerade_all=False))
    answers = {}
    for probe in probes:
        source, _, address, port, protocol = probe
        namespace, pod = source.split("/")
        question = Question((namespace, pod), AddressTarget(address), port, protocol)
        answers[probe] = explainer.explain(question)
    return answers


@dataclass
class Compared:
    disagreeing: list[str]
    denied: int
    """How many probes explain denies."""
    would_deny: int
    """How many probes explain would deny with the staged policies enforced."""


def _compared(lab: Lab, probes: list[Probe]) -> Compared:
    said = explained(lab, probes)
    seen = observed(lab, probes)
    verdict = {True: "allow", False: "deny"}
    disagreeing = [
        f"{source} -> {target}:{port}/{protocol}: explain says "
        f"{verdict[said[probe].allowed]}, the packets say {verdict[seen[probe]]}"
        for probe in probes
        for source, target, _, port, protocol in [probe]
        if said[probe].allowed != seen[probe]
    ]
    return Compared(
        disagreeing,
        sum(not answer.allowed for answer in said.values()),
        sum(not answer.would_allow for answer in said.values()),
    )


def _delete(lab: Lab, obj: dict[str, Any]) -> None:
    meta = obj["metadata"]
    kind = CLUSTER_POLICIES if obj["kind"] == "ClusterNetworkPolicy" else "netpol"
    where = ["-n", meta["namespace"]] if "namespace" in meta else []
    lab.kubectl(*where, "delete", kind, meta["name"], "--wait=false")


def test_explain_agrees_with_the_packets_in_every_scenario(lab: Lab, matrix: Matrix) -> None:
    probes = _probes(matrix)
    prefix = unique_name("agree")
    compared: dict[str, Compared] = {}
    for scenario, objects_of in SCENARIOS.items():
        objects = objects_of(matrix.names, matrix.addresses, prefix)
        if objects:
            _apply(lab, objects)

        def agree(scenario: str = scenario) -> bool:
            compared[scenario] = _compared(lab, probes)
            return not compared[scenario].disagreeing

        try:
            eventually(agree, AGREE_WITHIN, scenario, interval=1)
        except TimeoutError:
            pass
        finally:
            for obj in objects:
                _delete(lab, obj)
    for scenario, outcome in compared.items():
        print(f"{scenario:62} {len(probes)} probes, {outcome.denied:3} denied, "
              f"{outcome.would_deny:3} would be with the staged enforced, "
              f"{len(outcome.disagreeing)} disagreeing")  # fmt: skip
    assert {
        name: outcome.disagreeing for name, outcome in compared.items() if outcome.disagreeing
    } == {}
    denied = {name: outcome.denied for name, outcome in compared.items()}
    # each scenario's policies deny some probes and allow others, so both answers were compared;
    # a staged policy denies nothing, and would deny what the same policy enforced denies
    assert [name for name, count in denied.items() if not 0 < count < len(probes)] == [
        "no policy",
        STAGED,
    ]
    assert compared[STAGED].would_deny == denied["NetworkPolicy: deny all ingress"]


def _knit_args(lab: Lab) -> tuple[int, list[str]]:
    """The index of the DaemonSet's knit container, and its args."""
    daemonset = json.loads(
        lab.kubectl("-n", "kube-system", "get", "daemonset", "knit", "-o", "json")
    )
    containers = daemonset["spec"]["template"]["spec"]["containers"]
    index = next(i for i, c in enumerate(containers) if c["name"] == "knit")
    return index, list(containers[index]["args"])


def _set_knit_args(lab: Lab, index: int, args: list[str]) -> None:
    """knit-proxyd's flags replaced on the DaemonSet, rolled out node by node."""
    path = f"/spec/template/spec/containers/{index}/args"
    patch = json.dumps([{"op": "replace", "path": path, "value": args}])
    lab.kubectl("-n", "kube-system", "patch", "daemonset", "knit", "--type=json", "-p", patch)
    lab.kubectl(
        "-n", "kube-system", "rollout", "status", "daemonset/knit", "--timeout=300s", timeout=320
    )  # fmt: skip


@contextlib.contextmanager
def _flow_records(lab: Lab) -> Iterator[None]:
    """knit-proxyd keeping flow records, and as it was after. The lab's DaemonSet runs without
    them, and the rate is a flag only (no field of the ConfigMap's KubeProxyConfiguration)."""
    index, original = _knit_args(lab)
    wanted = [a for a in original if not a.startswith("--flow-records-rate")] + [FLOW_RECORDS]
    if wanted == original:
        yield
        return
    _set_knit_args(lab, index, wanted)
    try:
        yield
    finally:
        _set_knit_args(lab, index, original)


def test_verify_probes_from_the_source_pod_and_finds_the_kernel_agreeing(
    lab: Lab, matrix: Matrix, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """explain --verify's probes run in an ephemeral container of the source pod, and the
    daemons' flow records of them name the rule explain names: a TCP connection the policy
    isolating the pod drops times out, a UDP exchange its rule allows is answered, and a UDP
    exchange no policy judges is answered and leaves no record."""
    n = matrix.names
    # the records are read through kubectl exec into each node's knit pod
    monkeypatch.setenv("KUBECTL", str(KUBECTL))
    from_y = {"from": [{"namespaceSelector": _by_name(n.y)}],
              "ports": [{"port": 81, "protocol": "UDP"}]}  # fmt: skip
    only_udp_81 = netpol(n.x, "verify-only-udp-81", policyTypes=["Ingress"], ingress=[from_y])

    def verified(target: str, protocol: str) -> tuple[int, dict[str, Any]]:
        argv = ["explain", "--from", f"{n.y}/a", "--to", target, "--protocol", protocol,
                "--verify", "-o", "json", "--kubeconfig", str(lab.kubeconfig)]  # fmt: skip
        status = cli.main(argv)
        return status, json.loads(capsys.readouterr().out)

    def confirmed(target: str, protocol: str) -> tuple[int, dict[str, Any]] | None:
        """The answer once the probes agree and their records name the rule explained (the
        daemons program the policy a moment after the API has it)."""
        answer = verified(target, protocol)
        checked = answer[1]["verify"]
        agreeing = checked["agrees"] and all(p["rule"] == "agrees" for p in checked["probes"])
        return answer if agreeing else None

    with _flow_records(lab):
        _apply(lab, [only_udp_81])
        try:
            status, denied = eventually(
                partial(confirmed, f"pod/{n.x}/b:80", "TCP"), AGREE_WITHIN,
                "explain --verify agreeing on a denial", interval=1,
            )  # fmt: skip
            allowed_by_rule = eventually(
                partial(confirmed, f"pod/{n.x}/b:81", "UDP"), AGREE_WITHIN,
                "explain --verify agreeing on a rule's allow", interval=1,
            )  # fmt: skip
        finally:
            _delete(lab, only_udp_81)
        unjudged_status, unjudged = verified(f"pod/{n.z}/b:81", "UDP")
    assert status == 1 and denied["verdict"] == "deny"
    (probe,) = denied["verify"]["probes"]
    assert probe["outcome"] == "timed out"
    assert denied["verify"]["container"].startswith("knit-verify-")
    egress, ingress = probe["rules"]
    assert egress["judgement"] == "not checked" and egress["reason"].startswith(
        "no pod chain judges it"
    ), "no policy selects the source for egress: nothing records it"
    assert (ingress["node"], ingress["judgement"]) == (denied["connections"][0]["node"], "agrees")
    recorded = ingress["recorded"]
    assert (recorded["verdict"], recorded["direction"]) == ("deny", "ingress")
    assert recorded["decidedBy"] | {"reason": None} == {
        "kind": "NetworkPolicy", "namespace": n.x, "name": "verify-only-udp-81",
        "tier": "NetworkPolicy", "priority": None, "rule": None, "ruleName": None,
        "action": None, "reason": None,
    }  # fmt: skip
    status, allowed = allowed_by_rule
    assert status == 0 and allowed["verdict"] == "allow"
    (probe,) = allowed["verify"]["probes"]
    assert probe["outcome"] == "connected" and probe["rules"][1]["judgement"] == "agrees"
    decided = probe["rules"][1]["recorded"]["decidedBy"]
    assert (decided["name"], decided["rule"], probe["rules"][1]["recorded"]["verdict"]) == (
        "verify-only-udp-81", 0, "allow",
    )  # fmt: skip
    assert unjudged_status == 0 and unjudged["verdict"] == "allow"
    assert unjudged["verify"]["agrees"], unjudged["verify"]
    (probe,) = unjudged["verify"]["probes"]
    assert probe["outcome"] == "connected" and probe["rule"] == "not checked"
    assert [r["reason"].startswith("no pod chain judges it") for r in probe["rules"]] == [True] * 2
