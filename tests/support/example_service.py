"""One example service port and node, shared by the datapaths' rendering tests."""

from __future__ import annotations

import dataclasses

from proxyd.model import Endpoint, NodeInfo, ServicePort, ServicePortName
from proxyd.port_plan import FamilyContext, PortPlan, plan_port
from proxyd.tracker import Changes, ServiceView

NODE = NodeInfo("node-a", addresses=("192.0.2.10",))
CTX = FamilyContext(family=4, node=NODE, cluster_cidr="10.244.0.0/16")
CTX6 = dataclasses.replace(CTX, family=6, cluster_cidr="fd10::/48")
NAME = ServicePortName("ns", "web", "http", "TCP")
PORT = ServicePort(name=NAME, cluster_ips=("10.96.0.10", "fd00::10"), port=80)
READY = (Endpoint("10.244.1.5", 8080, node_name="node-a"), Endpoint("10.244.2.5", 8080))


def planned(
    port: ServicePort, endpoints: tuple[Endpoint, ...], ctx: FamilyContext = CTX
) -> PortPlan:
    """The port's plan; the port must have a cluster IP in ctx's family."""
    plan = plan_port(port, endpoints, ctx)
    assert plan is not None
    return plan


def changes(*ports: tuple[ServicePort, tuple[Endpoint, ...]]) -> Changes:
    views: dict[tuple[str, str], ServiceView] = {}
    for port, endpoints in ports:
        view = views.setdefault((port.name.namespace, port.name.name), ServiceView([], {}))
        view.ports.append(port)
        view.endpoints[port] = endpoints
    return Changes(services=views, node=NODE)
