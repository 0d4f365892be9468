"""What the lab's nodes hold, beside what the API server says should exist: the proof, after a
chaos run (deploy/lab/chaos.py), that nothing leaked and nothing was lost.

A node may hold, for pods: an address reservation and a veth per pod it runs, no more; in its
rules, sets and maps (iptables, ip6tables, ipset, nftables): addresses of pods and Services
that exist; in conntrack: no UDP entry translated to an address no pod has (the stale entry
that keeps a client sending to a deleted endpoint). Every Running pod has an address of each
family the cluster has.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import re
import time
from dataclasses import dataclass
from typing import Any

from deploy.lab.cluster import CLUSTER_CIDRS
from deploy.lab.controlplane import SERVICE_CIDRS
from deploy.lab.lab import Lab

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
POD_NETWORKS = [ipaddress.ip_network(cidr) for cidr in CLUSTER_CIDRS]
SERVICE_NETWORKS = [ipaddress.ip_network(cidr) for cidr in SERVICE_CIDRS]
STORE = "var/lib/cni/networks/knit"
RULESETS = (
    ("iptables-save",),
    ("ip6tables-save",),
    ("iptables-legacy-save",),
    ("ip6tables-legacy-save",),
    ("ipset", "save"),
    ("nft", "list", "ruleset"),
)
# an address (or a one-address prefix) in a rule: 10.96.0.10, 10.96.0.10/32,
# 10.244.1.5:8080 (iptables' --to-destination), [fd10:244::5]:8080, fd00:10:96::a
_TOKEN = re.compile(r"[\s,{}()]+")
# a Service's address, protocol and port in a rule: iptables' `-d 10.96.0.10/32 -p udp ...
# --dport 53` and nftables' map keys `10.96.0.10 . udp . 53`
_SERVICE_PORT = (
    re.compile(r"-d (\S+)/(?:32|128) -p (\w+) .*?--dport (\d+)"),
    re.compile(r"(\S+) \. (tcp|udp|sctp) \. (\d+)"),
)
_CONNTRACK_FIELD = re.compile(r"(src|dst)=(\S+)")


@dataclass(frozen=True)
class ApiView:
    """The objects the nodes' state is judged against."""

    pods: list[dict[str, Any]]
    service_addresses: frozenset[Address]
    service_ports: frozenset[tuple[Address, str, int]]
    node_addresses: frozenset[Address]
    """Each node's own addresses in its pod CIDRs, which rules may name: the network address
    (its VXLAN device's) and the first host (its bridge's)."""

    @property
    def pod_addresses(self) -> frozenset[Address]:
        return frozenset(
            ipaddress.ip_address(ip["ip"])
            for pod in self.pods
            for ip in pod["status"].get("podIPs", [])
        )

    def pods_on(self, node: str) -> list[dict[str, Any]]:
        return [
            pod
            for pod in self.pods
            if pod["spec"].get("nodeName") == node and not pod["spec"].get("hostNetwork")
        ]


def items(lab: Lab, *argv: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(lab.kubectl("get", *argv, "-o", "json"))["items"]
    return items


def api_view(lab: Lab) -> ApiView:
    services = items(lab, "services", "-A")
    nodes = items(lab, "nodes")
    return ApiView(
        pods=items(lab, "pods", "-A"),
        service_addresses=frozenset(
            ipaddress.ip_address(ip)
            for service in services
            for ip in service["spec"].get("clusterIPs", [])
            if ip != "None"
        ),
        service_ports=frozenset(
            (ipaddress.ip_address(ip), port.get("protocol", "TCP").lower(), port["port"])
            for service in services
            for ip in service["spec"].get("clusterIPs", [])
            if ip != "None"
            for port in service["spec"].get("ports", [])
        ),
        node_addresses=frozenset(
            ipaddress.ip_network(cidr)[index]
            for node in nodes
            for cidr in node["spec"].get("podCIDRs", [])
            for index in (0, 1)
        ),
    )


def addresses_in(text: str) -> set[Address]:
    """Every single address a ruleset's text names (prefixes wider than one address, such as
    the cluster's CIDRs in masquerade rules, are not addresses of a pod or a Service)."""
    found: set[Address] = set()
    for token in _TOKEN.split(text):
        if token.startswith("["):  # [v6]:port
            token = token[1 : token.find("]")]
        elif token.count(":") == 1:  # v4:port
            token = token.partition(":")[0]
        host, _, length = token.partition("/")
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            continue
        if not length or int(length) == address.max_prefixlen:
            found.add(address)
    return found


def service_ports_in(text: str) -> set[tuple[Address, str, int]]:
    """Every (address, protocol, port) a ruleset's text names as a Service's."""
    found = set()
    for pattern in _SERVICE_PORT:
        for address, protocol, port in pattern.findall(text):
            with contextlib.suppress(ValueError):
                found.add((ipaddress.ip_address(address), protocol, int(port)))
    return found


def _inside(
    address: Address, networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network]
) -> bool:
    return any(address in network for network in networks)


def stale_udp_entries(conntrack_text: str, pods: frozenset[Address]) -> list[str]:
    """conntrack -L lines of UDP entries translated to a pod address no pod has (the reply's
    source is the endpoint; the original's destination, the Service, differs from it)."""
    stale = []
    for line in conntrack_text.splitlines():
        fields = _CONNTRACK_FIELD.findall(line)
        if len(fields) < 4:
            continue
        original_destination, reply_source = fields[1][1], fields[2][1]
        endpoint = ipaddress.ip_address(reply_source)
        translated = original_destination != reply_source
        if translated and _inside(endpoint, POD_NETWORKS) and endpoint not in pods:
            stale.append(line.strip())
    return stale


def node_problems(lab: Lab, name: str, view: ApiView) -> list[str]:
    """What node NAME holds that no object of the view accounts for, or lacks."""
    node = lab.nodes[name]
    run = node.machine.run
    problems = []
    pods = view.pods_on(name)
    expected = sorted(ip["ip"] for pod in pods for ip in pod["status"].get("podIPs", []))
    store = node.folder / STORE
    reserved = sorted(p.name for p in store.iterdir() if p.name[0].isdigit() or ":" in p.name)
    if reserved != expected:
        extra, missing = (
            sorted(set(reserved) - set(expected)),
            sorted(set(expected) - set(reserved)),
        )
        problems.append(f"{name}: reservations without a pod {extra}, pods without one {missing}")
    # pods' veths on knit's bridge (the node's own leg is a veth too)
    veths = run("ip", "-o", "link", "show", "master", "knit0").count("\n")
    if veths != len(pods):
        problems.append(f"{name}: {veths} veths on the bridge for {len(pods)} pods")
    rules = "\n".join(run(*argv) for argv in RULESETS)
    for address in sorted(addresses_in(rules), key=str):
        if (
            _inside(address, POD_NETWORKS)
            and address not in view.pod_addresses | view.node_addresses
        ):
            problems.append(f"{name}: rules name {address}, which no pod has")
        if _inside(address, SERVICE_NETWORKS) and address not in view.service_addresses:
            problems.append(f"{name}: rules name {address}, which no Service has")
    for address, protocol, port in sorted(service_ports_in(rules), key=str):
        if (
            _inside(address, SERVICE_NETWORKS)
            and (address, protocol, port) not in view.service_ports
        ):
            problems.append(f"{name}: rules name {address} {protocol} {port}, no Service's port")
    conntrack = "".join(
        run("conntrack", "-L", "-f", family, "-p", "udp") for family in ("ipv4", "ipv6")
    )
    for line in stale_udp_entries(conntrack, view.pod_addresses):
        problems.append(f"{name}: conntrack entry to a deleted endpoint: {line}")
    return problems


# every URL given fetched once; the ones that do not answer printed
UNANSWERED = 'for u; do curl -sf -m 2 -g -o /dev/null "$u" || echo "$u"; done'


def unreachable(lab: Lab, namespace: str, port: int) -> list[str]:
    """The addresses of NAMESPACE's Running pods that do not answer HTTP on port from one node
    or another (the pods must all serve it)."""
    pods = items(lab, "pods", "-n", namespace, "--field-selector", "status.phase=Running")
    urls = [
        f"http://[{ip['ip']}]:{port}/" if ":" in ip["ip"] else f"http://{ip['ip']}:{port}/"
        for pod in pods
        if not pod["metadata"].get("deletionTimestamp")
        for ip in pod["status"].get("podIPs", [])
    ]
    return [
        f"{name}: no answer from {url}"
        for name, node in lab.nodes.items()
        for url in node.machine.run("sh", "-c", UNANSWERED, "sh", *urls).split()
    ]


def unready(lab: Lab, namespace: str) -> list[str]:
    """NAMESPACE's pods that are not Ready or still going away, each with what says why: its
    node, phase, conditions that are not true, and the last event about it."""
    events: dict[str, str] = {}
    for event in items(lab, "events", "-n", namespace, "--sort-by=.lastTimestamp"):
        events[event["involvedObject"].get("name", "")] = (
            f"{event.get('reason')}: {event.get('message', '').strip()[:160]}"
        )
    found = []
    for pod in items(lab, "pods", "-n", namespace):
        name, status = pod["metadata"]["name"], pod["status"]
        false = [
            f"{cond['type']}={cond['status']}"
            + (f" ({cond['reason']})" if cond.get("reason") else "")
            for cond in status.get("conditions", [])
            if cond["status"] != "True"
        ]
        going = pod["metadata"].get("deletionTimestamp")
        if false or going or not status.get("conditions"):
            found.append(
                f"{name} on {pod['spec'].get('nodeName')}: {status.get('phase')}"
                + (f", deleted at {going}" if going else "")
                + (f", {', '.join(false)}" if false else "")
                + (f"; last event {events[name]}" if name in events else "")
            )
    return found


def problems(lab: Lab) -> list[str]:
    """Every node's problems, and every Running pod without an address of both families."""
    view = api_view(lab)
    found = [
        f"{pod['metadata']['namespace']}/{pod['metadata']['name']}: addresses {ips}"
        for pod in view.pods
        if pod["status"].get("phase") == "Running" and not pod["spec"].get("hostNetwork")
        for ips in [[ip["ip"] for ip in pod["status"].get("podIPs", [])]]
        if len(ips) != len(CLUSTER_CIDRS)
    ]
    for name in lab.nodes:
        found += node_problems(lab, name, view)
    return found


def settled(lab: Lab) -> bool:
    """Whether the audit finds nothing, twice, two seconds apart: what is still changing (a pod
    going away, a sync in flight) is not a leak."""
    if problems(lab):
        return False
    time.sleep(2)
    return not problems(lab)
