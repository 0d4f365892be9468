"""`kubectl-knit`, the kubectl plugin: `kubectl knit explain` lists the objects the daemons
watch, parses them with the daemons' parsers, and prints what explain.py makes of them;
`kubectl knit flows` prints the daemons' flow records (flows.py).

Exit status: 0 when the connection is allowed, 1 when it is denied, 2 when the question
cannot be answered (a bad argument, an object missing, the API server unreachable), 3 when
--verify's probes or their flow records disagree with the answer.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client
from kubernetes import config as kubeconfig

from proxyd import kubeapi, watch
from proxyd.explain import flows, probe, verify
from proxyd.explain.explain import (
    AddressTarget,
    Explainer,
    ExplainError,
    Explanation,
    NamedTarget,
    PodTarget,
    Question,
    Service,
    ServiceTarget,
    Target,
    World,
)
from proxyd.explain.output import to_json, to_text, verification_json, verification_text
from proxyd.explain.verify import Verification
from proxyd.model import (
    PROTOCOLS,
    EndpointSlice,
    Obj,
    parse_endpoint_slice,
    parse_node,
    parse_or_skip,
    parse_service,
)
from proxyd.policy.cluster_model import ClusterNetworkPolicy, parse_cluster_policy
from proxyd.policy.compile import PodKey
from proxyd.policy.flow_server import socket_path as flow_socket
from proxyd.policy.flows import ALLOWED, DENIED
from proxyd.policy.model import (
    Namespace,
    NetworkPolicy,
    Pod,
    parse_namespace,
    parse_pod,
    parse_policy,
)

Parsed = TypeVar("Parsed")
KINDS: dict[str, type[PodTarget | ServiceTarget]] = {
    "pod": PodTarget,
    "service": ServiceTarget,
    "svc": ServiceTarget,
}


def parse_target(text: str) -> tuple[Target, int | str]:
    """`[pod/|service/|svc/]NS/NAME:PORT` or `IP:PORT` (`[IPv6]:PORT`); a PORT of digits is a
    number, any other a name."""
    where, colon, port = text.rpartition(":")
    if not colon or not where or not port:
        raise ExplainError(f"{text!r} is not NS/NAME:PORT nor IP:PORT")
    number: int | str = int(port) if port.isdigit() else port
    if isinstance(number, int) and not 1 <= number <= 65535:
        raise ExplainError(f"port {number} is not from 1 to 65535")
    address = where[1:-1] if where.startswith("[") and where.endswith("]") else where
    try:
        return AddressTarget(str(ipaddress.ip_address(address))), number
    except ValueError:
        pass
    parts = where.split("/")
    if len(parts) == 3 and parts[0] in KINDS and all(parts[1:]):
        return KINDS[parts[0]](parts[1], parts[2]), number
    if len(parts) == 2 and all(parts):
        return NamedTarget(parts[0], parts[1]), number
    raise ExplainError(f"{where!r} is not NS/NAME, pod/NS/NAME, service/NS/NAME nor an address")


def parse_pod_key(text: str) -> PodKey:
    namespace, _, name = text.partition("/")
    if not namespace or not name or "/" in name:
        raise ExplainError(f"{text!r} is not NS/POD")
    return namespace, name


def _listed(api: kubeapi.Api, resource: watch.Resource) -> list[Obj]:
    """The resource's objects, listed in pages as the daemons list them; none when the API
    server does not serve an optional resource."""
    reflector = watch.Reflector(api, resource, lambda _: None, lambda *_: None, threading.Event())
    try:
        return reflector.list()[0]
    except watch.NotServed:
        return []


def _parsed(objs: list[Obj], parse: Callable[[Obj], Parsed | None], kind: str) -> list[Parsed]:
    return [p for obj in objs if (p := parse_or_skip(parse, obj, kind)) is not None]


def fetch_world(api: kubeapi.Api, masquerade_all: bool) -> World:
    """What the daemons watch, parsed by their parsers (what they skip is skipped here, and
    logged the same way)."""
    pods: list[Pod] = _parsed(_listed(api, watch.pods()), parse_pod, "Pod")
    namespaces: list[Namespace] = _parsed(
        _listed(api, watch.namespaces()), parse_namespace, "Namespace"
    )
    policies: list[NetworkPolicy] = _parsed(
        _listed(api, watch.network_policies()), parse_policy, "NetworkPolicy"
    )
    cluster_policies: list[ClusterNetworkPolicy] = _parsed(
        _listed(api, watch.cluster_network_policies()),
        parse_cluster_policy,
        "ClusterNetworkPolicy",
    )
    services = {}
    for obj in _listed(api, watch.services()):
        ports = parse_or_skip(parse_service, obj, "Service")
        if ports:
            spec = obj.get("spec") or {}
            namespace, name = ports[0].name.namespace, ports[0].name.name
            services[namespace, name] = Service(
                namespace, name, str(spec.get("type") or "ClusterIP"), tuple(ports)
            )
    slices: dict[tuple[str, str], tuple[EndpointSlice, ...]] = {}
    listed = _listed(api, watch.endpoint_slices())
    for endpoint_slice in _parsed(listed, parse_endpoint_slice, "EndpointSlice"):
        key = (endpoint_slice.namespace, endpoint_slice.service)
        slices[key] = (*slices.get(key, ()), endpoint_slice)
    nodes = _parsed(_listed(api, watch.nodes()), parse_node, "Node")
    return World(
        {(pod.namespace, pod.name): pod for pod in pods},
        {namespace.name: namespace for namespace in namespaces},
        tuple(policies),
        tuple(cluster_policies),
        services,
        slices,
        {node.name: node for node in nodes},
        masquerade_all,
    )


def lister(kubeconfig_path: str | None) -> kubeapi.Api:
    """The client the daemons list with, for the same kubeconfig as api_client's."""
    paths = [Path(kubeconfig_path)] if kubeconfig_path else kubeapi.default_kubeconfigs()
    return kubeapi.from_kubeconfig(paths)


def api_client(kubeconfig_path: str | None) -> client.ApiClient:
    configuration = client.Configuration()
    kubeconfig.load_kube_config(config_file=kubeconfig_path, client_configuration=configuration)
    return client.ApiClient(configuration)


def _arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kubectl knit", description="Ask knit about the cluster's network."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    explain = commands.add_parser(
        "explain",
        help="the path of a new connection from a pod, and the rules that decide it",
        description="The path a new connection from a pod takes and the policy rules that "
        "decide it, computed from the API objects by knit-proxyd's own code "
        "(docs/observability.md).",
    )
    explain.add_argument("--from", dest="source", required=True, metavar="NS/POD")
    explain.add_argument(
        "--to",
        required=True,
        metavar="NS/NAME:PORT|IP:PORT",
        help="a Service (if one has that name, else a pod; prefix pod/ or service/ to say "
        "which), or an address; PORT a number or a name",
    )
    explain.add_argument("--protocol", default="TCP", type=str.upper, choices=PROTOCOLS)
    explain.add_argument(
        "--endpoint",
        metavar="IP",
        help="of a Service's eligible endpoints, explain only this one (default: each)",
    )
    explain.add_argument("-o", "--output", default="text", choices=("text", "json"))
    explain.add_argument(
        "--verify",
        action="store_true",
        help="probe the connections from the source pod (an ephemeral container) and say "
        "whether the kernel agrees, and whether the daemons' flow records of the probes (where "
        "they keep them) name the deciding rule explained; exit status 3 when either does not",
    )
    explain.add_argument(
        "--probe-image",
        default=probe.IMAGE,
        metavar="IMAGE",
        help="the image of --verify's ephemeral container: agnhost (its connect command), "
        "with a shell",
    )
    explain.add_argument("--kubeconfig", help="default: $KUBECONFIG, else ~/.kube/config")
    explain.add_argument(
        "--masquerade-all",
        action="store_true",
        help="the daemons run with --masquerade-all (their masquerade changes the address "
        "another node's ingress policies see)",
    )
    _flows_arguments(commands)
    return parser


def _flows_arguments(commands: Any) -> None:
    parser = commands.add_parser(
        "flows",
        help="the connections the nodes' policies judged, with the rule that decided each",
        description="The flow records of each node's knit-proxyd (run with "
        "--flow-records-rate), read through kubectl exec into the node's knit pod "
        "(docs/observability.md#flows).",
    )
    parser.add_argument("--node", help="only this node's records")
    parser.add_argument("--namespace", help="only connections with a pod of this namespace")
    parser.add_argument("--pod", metavar="[NS/]POD", help="only connections with this pod")
    parser.add_argument("--verdict", choices=(ALLOWED, DENIED))
    parser.add_argument(
        "--staged",
        action="store_true",
        help="only connections that staged policies would decide otherwise",
    )
    parser.add_argument("-f", "--follow", action="store_true", help="go on with new records")
    parser.add_argument("-o", "--output", default="text", choices=("text", "json"))
    parser.add_argument("--kubeconfig", help="default: $KUBECONFIG, else ~/.kube/config")
    parser.add_argument(
        "--local",
        action="store_true",
        help="read this node's daemon's socket (what the command runs in the knit pod)",
    )
    parser.add_argument("--socket", default=flow_socket(""), help=argparse.SUPPRESS)


def knit_pods(api: client.ApiClient, node: str | None) -> dict[str, str]:
    """Node -> the knit pod running there (not one going away, which a rollout leaves
    running beside its successor for a moment)."""
    listed = client.CoreV1Api(api).list_namespaced_pod(
        flows.KNIT_NAMESPACE, label_selector=flows.KNIT_SELECTOR
    )
    found = {}
    for pod in listed.items:
        node_name = pod.spec.node_name if pod.spec else None
        running = pod.status is not None and pod.status.phase == "Running"
        meta = pod.metadata
        if node_name and running and meta and meta.name and not meta.deletion_timestamp:
            found[node_name] = meta.name
    return {n: p for n, p in found.items() if node is None or n == node}


def flows_main(arguments: argparse.Namespace) -> int:
    chosen = flows.Filter(
        arguments.node, arguments.namespace, arguments.pod, arguments.verdict, arguments.staged
    )
    if arguments.local:
        return flows.local(arguments.socket, chosen, arguments.follow, arguments.output)
    try:
        binary = flows.kubectl()
        pods = knit_pods(api_client(arguments.kubeconfig), arguments.node)
        if not pods:
            raise flows.FlowsError(f"no running knit pod in {flows.KNIT_NAMESPACE}")
    except (flows.FlowsError, OSError, kubeconfig.ConfigException) as err:
        print(f"kubectl knit flows: {err}", file=sys.stderr)
        return 2
    commands = [
        flows.exec_command(binary, pod, chosen, arguments.follow, arguments.kubeconfig)
        for _, pod in sorted(pods.items())
    ]
    failures = flows.gather(
        commands,
        arguments.follow,
        lambda record: flows.print_records([record], arguments.output, sys.stdout),
    )
    for failure in failures:
        print(f"kubectl knit flows: {failure}", file=sys.stderr)
    return 2 if failures else 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return _answer(_arguments().parse_args(argv))
    except BrokenPipeError:
        # the reader went away (`| head`, a pager quit): stop quietly, as a Unix filter does,
        # with stdout pointed at /dev/null so the interpreter's last flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _answer(arguments: argparse.Namespace) -> int:
    if arguments.command == "flows":
        return flows_main(arguments)
    try:
        target, port = parse_target(arguments.to)
        question = Question(
            parse_pod_key(arguments.source), target, port, arguments.protocol, arguments.endpoint
        )
        world = fetch_world(lister(arguments.kubeconfig), arguments.masquerade_all)
        explanation = Explainer(world).explain(question)
        verification = (
            _verified(
                api_client(arguments.kubeconfig),
                explanation,
                arguments.probe_image,
                arguments.kubeconfig,
            )
            if arguments.verify
            else None
        )
    except (
        ExplainError,
        ConnectionError,
        OSError,
        kubeconfig.ConfigException,
        kubeapi.ConfigError,
    ) as err:
        print(f"kubectl knit explain: {err}", file=sys.stderr)
        return 2
    if arguments.output == "json":
        answer = to_json(explanation)
        answer["verify"] = None if verification is None else verification_json(verification)
        print(json.dumps(answer, indent=2))
    else:
        text = to_text(explanation)
        print(text + ("" if verification is None else verification_text(verification)), end="")
    if verification is not None and not verification.agrees:
        return 3
    return 0 if explanation.allowed else 1


def _verified(
    api: client.ApiClient, explanation: Explanation, image: str, kubeconfig: str | None
) -> Verification:
    probes, skipped = verify.probes(explanation)
    namespace, pod = explanation.source
    if not probes:
        return Verification("-", (), tuple(skipped))
    since = time.time()
    container, answers = probe.run(api, namespace, pod, probes, image)
    # the container is seen ended a status update after its last probe at the soonest, and
    # NFLOG hands the daemons a record within 0.1 s: they hold the probes' records by now
    records = read_records(api, explanation.source, verify.judging_nodes(probes), since, kubeconfig)
    checked = tuple(verify.checked(explanation, answer, records) for answer in answers)
    return Verification(container, checked, tuple(skipped))


def read_records(
    api: client.ApiClient, source: PodKey, nodes: set[str], since: float, kubeconfig: str | None
) -> verify.Records:
    """The source pod's flow records, from each node's daemon as `kubectl knit flows` reads
    them; a node whose records cannot be read is left with why."""
    try:
        binary = flows.kubectl()
        pods = knit_pods(api, None)
    except (flows.FlowsError, client.ApiException) as err:
        why = f"{err.status} {err.reason}" if isinstance(err, client.ApiException) else str(err)
        return verify.Records(since, (), {node: why for node in nodes})
    chosen = flows.Filter(pod="/".join(source))
    commands = {
        node: flows.exec_command(binary, pods[node], chosen, False, kubeconfig)
        for node in sorted(nodes)
        if node in pods
    }
    found, unread = flows.read_nodes(commands)
    missing = {node: f"no running knit pod in {flows.KNIT_NAMESPACE}" for node in nodes - set(pods)}
    return verify.Records(since, tuple(found), {**unread, **missing})
