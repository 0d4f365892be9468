"""Where the daemon's work per call goes: the plugin's steps timed around cni.plugin.execute,
the function the fast path's daemon runs, over ADD, CHECK and DEL of the given pods.

Run inside a node namespace by bench.cni_bench, which prints the result:
    python -m bench.cni_steps CONFLIST_JSON POD_NETNS...
Prints JSON: {verb: {step: median ms per call}}. A step's time is its own, without the steps
it calls (every link lookup counts as one); "other" is the call's time outside every step (the
verb's own code, the result's JSON), "total" the whole call.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from cni import bridge, masq, netconf, plugin
from cni import ipam as ipam_module
from cni.ipam.hostlocal import HostLocal
from cni.kernel import netns

# (owner, function name, label): each patched where its callers look it up
STEPS: list[tuple[Any, str, str]] = [
    (netconf, "parse", "parse the config"),
    (ipam_module, "for_config", "parse the IPAM config"),
    (netns, "open_netns", "open the pod's netns"),
    (bridge, "container_has_interface", "look for eth0 in the pod"),
    (HostLocal, "add", "host-local: reserve"),
    (HostLocal, "check", "host-local: check"),
    (HostLocal, "release", "host-local: release"),
    (bridge, "ensure_bridge", "bridge: ensure"),
    (bridge, "ensure_gateway_addresses", "bridge: gateway addresses"),
    (bridge, "create_veth", "veth: create"),
    (bridge, "link_by_name", "look links up by name"),
    (bridge, "forget_neighbours", "bridge: forget the pod's neighbour entries"),
    (bridge, "attach_to_bridge", "veth: attach"),
    (bridge, "configure_container", "pod: addresses, link up, routes"),
    (bridge, "announce", "pod: announce its addresses"),
    (bridge, "enable_forwarding", "forwarding sysctls"),
    (bridge, "check", "compare the kernel with prevResult"),
    (plugin, "_delete_attachment_links", "delete the veth"),
    (masq, "detect_iptables_flavour", "masquerade: the iptables flavour"),
    (masq, "setup", "masquerade: write rules"),
    (masq, "present", "masquerade: look for rules"),
    (masq, "teardown", "masquerade: remove rules"),
]

spent: dict[str, float] = {}
inner: list[float] = []
"""Per step running, the time of the steps it called so far."""


def timed(function: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        inner.append(0.0)
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            elapsed = time.perf_counter() - start
            own = elapsed - inner.pop()
            spent[label] = spent.get(label, 0.0) + own
            if inner:
                inner[-1] += elapsed

    return wrapper


def main() -> None:
    conf, pods = json.loads(sys.argv[1]), sys.argv[2:]
    for owner, name, label in STEPS:
        setattr(owner, name, timed(getattr(owner, name), label))
    per_verb: dict[str, dict[str, list[float]]] = {}
    results: dict[str, dict[str, Any]] = {}
    for verb in ("ADD", "CHECK", "DEL"):
        for pod in pods:
            env = {
                "CNI_COMMAND": verb,
                "CNI_CONTAINERID": pod,
                "CNI_NETNS": f"/var/run/netns/{pod}",
                "CNI_IFNAME": "eth0",
            }
            asked = {**conf, "prevResult": results[pod]} if verb == "CHECK" else conf
            spent.clear()
            start = time.perf_counter()
            code, output = plugin.execute(env, json.dumps(asked).encode())
            total = time.perf_counter() - start
            if code:
                sys.exit(f"{verb} {pod}: {output.decode()}")
            if verb == "ADD":
                results[pod] = json.loads(output)
            steps = dict(spent)
            steps["other"] = total - sum(spent.values())
            steps["total"] = total
            for label, seconds in steps.items():
                per_verb.setdefault(verb, {}).setdefault(label, []).append(seconds)
    print(
        json.dumps(
            {
                verb: {label: round(statistics.median(v) * 1000, 2) for label, v in steps.items()}
                for verb, steps in per_verb.items()
            }
        )
    )


if __name__ == "__main__":
    main()
