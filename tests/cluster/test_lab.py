"""The lab's real cluster (kubelet and containerd on every node, knit run by its DaemonSet),
judged by real pods, by the upstream e2e suite and by network-policy-api's conformance suite,
once per proxy mode this kernel has: iptables
and nftables (no IPVS in this kernel). The JUnit reports stay under build/e2e/MODE/."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import yaml

from cni.install import installed_version
from deploy.lab import e2e, image
from deploy.lab.lab import KUBECTL, Lab
from deploy.lab.paths import IMAGES
from deploy.lab.process import eventually
from proxyd.nodenet import source_nat

# bringing a lab up takes a minute or two; the e2e selection tens of minutes
pytestmark = pytest.mark.timeout(3600)


def test_traffic_flows_between_real_pods(lab: Lab) -> None:
    checks = lab.checks()
    assert [check for check in checks if not check.passed] == []
    assert len(checks) == 7


def test_every_network_conformance_spec_passes(lab: Lab) -> None:
    conformance = e2e.SELECTIONS["conformance"]
    outcome = e2e.run(lab.kubeconfig, e2e.E2E / lab.mode, conformance, len(lab.nodes))
    assert outcome.failed == []
    assert outcome.passed


def test_every_network_policy_spec_passes(lab: Lab) -> None:
    """The upstream Netpol specs (48; those probing over SCTP skip), about 4 minutes. Policy
    is the same nftables table in every proxy mode, so `make test` runs them in one, as it
    does the suite below; `make e2e ARGS="--selection netpol"` runs them in both."""
    if lab.mode != "nftables":
        pytest.skip("the specs run in the nftables mode's lab; make e2e runs both modes")
    netpol = e2e.SELECTIONS["netpol"]
    outcome = e2e.run(lab.kubeconfig, e2e.E2E / lab.mode / "netpol", netpol, len(lab.nodes))
    assert outcome.failed == []
    assert len(outcome.passed) >= 48


def test_every_cluster_network_policy_conformance_test_passes(lab: Lab) -> None:
    """network-policy-api's conformance suite: its 18 tests that run here (e2e.run_cnp),
    about 10 minutes. Policy is the same nftables table in every proxy mode, so `make test`
    runs the suite in one; `make e2e ARGS="--selection cnp"` runs it in both."""
    if lab.mode != "nftables":
        pytest.skip("the suite runs in the nftables mode's lab; make e2e runs both modes")
    outcome = e2e.run_cnp(lab.kubeconfig, e2e.E2E / lab.mode / "cnp")
    assert outcome.failed == []
    assert sorted(outcome.passed) == sorted(e2e.CNP_TESTS)


# ---------------------------------------------------------------- knit's own life on real nodes

NEXT_RELEASE = "next"
BUNDLE_MANIFEST = "/opt/knit/cni-bundle/manifest.json"
# a client that fetches until the file named by $STOP exists, one line per request: its time
# and whether it was answered
LOOP = (
    'until [ -e "$STOP" ]; do '
    'curl -sf -m 2 -o /dev/null -w "%{time_total} " "$URL" && echo ok || echo failed; done'
)


def _loop_in_pod(lab: Lab, url: str, stop: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(KUBECTL), f"--kubeconfig={lab.kubeconfig}", "exec", "client", "--",
         "env", f"URL={url}", f"STOP={stop}", "sh", "-c", LOOP],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _loop_outside(lab: Lab, url: str, stop: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", lab.outside, "env", f"URL={url}", f"STOP={stop}", "sh", "-c", LOOP],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


# one connection held open across the change: a request before, one after $STOP exists
HOLD = r"""
exec 3<>"/dev/tcp/$HOST/$PORT"
ask() {
  printf 'GET /hostname HTTP/1.1\r\nHost: web\r\n\r\n' >&3
  IFS= read -r -t 5 status <&3 || { echo "no answer"; return; }
  length=0
  while IFS= read -r -t 5 line <&3 && [ "$line" != $'\r' ]; do
    case "$line" in [Cc]ontent-[Ll]ength:*) length=${line#*: }; length=${length%$'\r'} ;; esac
  done
  IFS= read -r -t 5 -N "$length" body <&3
  echo "${status%$'\r'} $body"
}
ask
until [ -e "$STOP" ]; do sleep 0.2; done
ask
"""


def _hold_in_pod(lab: Lab, host: str, port: int, stop: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(KUBECTL), f"--kubeconfig={lab.kubeconfig}", "exec", "client", "--",
         "env", f"HOST={host}", f"PORT={port}", f"STOP={stop}", "bash", "-c", HOLD],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _hold_outside(lab: Lab, host: str, port: int, stop: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        ["ip", "netns", "exec", lab.outside,
         "env", f"HOST={host}", f"PORT={port}", f"STOP={stop}", "bash", "-c", HOLD],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


@dataclass(frozen=True)
class Loop:
    """What a steady client saw: requests made, failed, and the longest wait for an answer
    (the summed times of the requests from one answer to the next)."""

    made: int
    failed: int
    longest_wait: float

    def __str__(self) -> str:
        return f"{self.made} requests, {self.failed} failed, longest wait {self.longest_wait:.2f} s"


def _loop_result(proc: subprocess.Popen[str]) -> Loop:
    lines = proc.communicate(timeout=60)[0].splitlines()
    failed = 0
    waited = longest = 0.0
    for line in lines:
        seconds, outcome = line.split()
        waited += float(seconds)
        if outcome == "ok":
            longest, waited = max(longest, waited), 0.0
        else:
            failed += 1
    return Loop(len(lines), failed, max(longest, waited))


def _first_line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return proc.stdout.readline().strip()


@dataclass(frozen=True)
class UnderTraffic:
    """One change of knit made under steady clients and held connections."""

    change: str
    seconds: float
    inside: Loop
    outside: Loop
    held: tuple[list[str], list[str]]

    def __str__(self) -> str:
        return (
            f"{self.change} in {self.seconds:.0f} s: a pod to a ClusterIP {self.inside}; "
            f"outside to a NodePort {self.outside}"
        )


def _under_traffic(lab: Lab, tmp_path: Path, change: str, make: Callable[[], None]) -> UnderTraffic:
    """make() run while the client pod fetches through the demo's ClusterIP and the outside
    host through node2's NodePort without pause, each also holding one connection, asked once
    before the change and once after it. Checks both clients kept fetching and both held
    connections were answered twice by one pod; the failed requests are the caller's to judge
    (_no_request_failed)."""
    web = json.loads(lab.kubectl("get", "service", "web", "-o", "json"))["spec"]
    node_port, cluster_ip = web["ports"][0]["nodePort"], web["clusterIP"]
    node2 = lab.nodes["node2"].addresses[0]
    name = f"stop-{time.monotonic_ns()}"
    in_pod, outside = f"/tmp/{name}", tmp_path / name
    holds = (
        _hold_in_pod(lab, cluster_ip, 80, in_pod),
        _hold_outside(lab, node2, node_port, outside),
    )
    # both connections open and answered before anything changes
    first = [_first_line(hold) for hold in holds]
    loops = (
        _loop_in_pod(lab, "http://web/hostname", in_pod),
        _loop_outside(lab, f"http://{node2}:{node_port}/hostname", outside),
    )
    began = time.monotonic()
    make()
    seconds = time.monotonic() - began
    lab.kubectl("exec", "client", "--", "touch", in_pod)
    outside.touch()
    inside_loop, outside_loop = (_loop_result(loop) for loop in loops)
    held_inside, held_outside = (
        [answer, *hold.communicate(timeout=60)[0].splitlines()]
        for answer, hold in zip(first, holds, strict=True)
    )
    run = UnderTraffic(change, seconds, inside_loop, outside_loop, (held_inside, held_outside))
    print(run)
    assert run.inside.made > 10 and run.outside.made > 10, run
    for held in run.held:
        # both requests answered on the one connection, so by the same pod
        assert len(held) == 2 and held[0] == held[1] and held[0].startswith("HTTP/1.1 200 "), held
    return run


def _no_request_failed(*runs: UnderTraffic) -> None:
    failed = [str(run) for run in runs if run.inside.failed or run.outside.failed]
    assert not failed, "; ".join(failed)


def _knit_pods(lab: Lab, jsonpath: str) -> list[str]:
    return lab.kubectl(
        "-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=knit",
        "-o", f"jsonpath={jsonpath}",
    ).split()  # fmt: skip


def _knit_image(lab: Lab) -> str:
    return lab.kubectl(
        "-n", "kube-system", "get", "daemonset", "knit",
        "-o", "jsonpath={.spec.template.spec.containers[0].image}",
    )  # fmt: skip


def _set_image(lab: Lab, image_name: str) -> None:
    lab.kubectl("-n", "kube-system", "set", "image", "daemonset/knit", f"knit={image_name}")


def _rolled_out(lab: Lab) -> None:
    lab.kubectl(
        "-n", "kube-system", "rollout", "status", "daemonset/knit", "--timeout=300s", timeout=320
    )  # fmt: skip


def _bundle_version(lab: Lab) -> str:
    """The version of the plugin bundle in a running knit pod's image."""
    knit_pod = _knit_pods(lab, "{.items[0].metadata.name}")[0]
    manifest = lab.kubectl("-n", "kube-system", "exec", knit_pod, "--", "cat", BUNDLE_MANIFEST)
    version: str = json.loads(manifest)["version"]
    return version


def _installed_versions(lab: Lab) -> set[str | None]:
    return {installed_version(node.folder / "opt/cni/bin") for node in lab.nodes.values()}


def test_a_rolling_update_of_knit_and_its_rollback_lose_no_connection(
    lab: Lab, tmp_path: Path
) -> None:
    lab.deploy_demo()
    # the new release (other plugin bytes, so another bundle version) on every node, as a
    # registry would serve it
    archive = image.build_knit_release(IMAGES, NEXT_RELEASE)
    next_image = image.image_names(archive)[0]
    for node in lab.nodes.values():
        image.import_images(node.ctr(), [archive])
    original_image, original_version = _knit_image(lab), _bundle_version(lab)
    assert _installed_versions(lab) == {original_version}

    def upgrade() -> None:
        _set_image(lab, next_image)
        # a pod made while the update runs
        lab.kubectl(
            "run", "during", "--image=registry.k8s.io/e2e-test-images/agnhost:2.66.1",
            "--", "netexec", "--http-port=8080",
        )  # fmt: skip
        _rolled_out(lab)

    upgraded = _under_traffic(lab, tmp_path, f"rolling update to {next_image}", upgrade)
    _no_request_failed(upgraded)
    images = _knit_pods(lab, "{.items[*].spec.containers[0].image}")
    assert images == [next_image] * len(lab.nodes)
    new_version = _bundle_version(lab)
    assert new_version != original_version and _installed_versions(lab) == {new_version}
    lab.kubectl("wait", "--for=condition=Ready", "pod/during", "--timeout=120s", timeout=130)
    during = json.loads(lab.kubectl("get", "pod", "during", "-o", "json"))["status"]["podIP"]
    assert (
        lab.kubectl(
            "exec", "client", "--", "curl", "-sS", "-m", "5", f"http://{during}:8080/hostname"
        )
        == "during"
    )

    def downgrade() -> None:
        _set_image(lab, original_image)
        _rolled_out(lab)

    # back to the lab's own release, the way it came, so the tests after this one run on it
    downgraded = _under_traffic(lab, tmp_path, f"rollback to {original_image}", downgrade)
    _no_request_failed(downgraded)
    images = _knit_pods(lab, "{.items[*].spec.containers[0].image}")
    assert images == [original_image] * len(lab.nodes)
    assert _bundle_version(lab) == original_version
    assert _installed_versions(lab) == {original_version}


# where each mode keeps knit's Service rules; node networking's source NAT is in iptables in
# every mode, and the policy tables in nftables
IPTABLES_SAVES = (
    "iptables-legacy-save",
    "iptables-nft-save",
    "ip6tables-legacy-save",
    "ip6tables-nft-save",
)
PROXY_TABLES = {"table ip knit", "table ip6 knit"}
POLICY_TABLES = {"table ip knit-policy", "table ip6 knit-policy"}


def _service_rules(lab: Lab, name: str) -> tuple[list[str], set[str]]:
    """Node NAME's KNIT- chains in iptables, both flavours and families (each as
    SAVE-COMMAND:TABLE:CHAIN), but the source NAT's, and its nftables tables."""
    run = lab.nodes[name].machine.run
    chains = []
    for save in IPTABLES_SAVES:
        table = ""
        for line in run(save).splitlines():
            if line.startswith("*"):
                table = line[1:]
            elif line.startswith(":KNIT-") and line.split()[0][1:] not in source_nat.CHAINS:
                chains.append(f"{save}:{table}:{line.split()[0][1:]}")
    return chains, set(run("nft", "list", "tables").splitlines())


def _switched(lab: Lab, name: str, mode: str) -> bool:
    """Node NAME serves Services by MODE's rules alone, and its policy tables stay."""
    chains, tables = _service_rules(lab, name)
    if mode == "iptables":
        alone = bool(chains) and not tables & PROXY_TABLES
    else:
        alone = tables >= PROXY_TABLES and not chains
    return alone and tables >= POLICY_TABLES


def _knit_config(lab: Lab) -> str:
    configmap = lab.kubectl("-n", "kube-system", "get", "configmap", "knit-config", "-o", "json")
    config: str = json.loads(configmap)["data"]["config.yaml"]
    return config


def _restart_with(lab: Lab, config: str) -> None:
    """knit-proxyd's config file replaced and its DaemonSet restarted, one node at a time."""
    patch = json.dumps({"data": {"config.yaml": config}})
    lab.kubectl("-n", "kube-system", "patch", "configmap", "knit-config", "-p", patch)
    lab.kubectl("-n", "kube-system", "rollout", "restart", "daemonset/knit")
    _rolled_out(lab)


def test_a_live_switch_of_proxy_mode_and_back_loses_no_connection(lab: Lab, tmp_path: Path) -> None:
    """iptables to nftables and back through the ConfigMap, as a user switches: the old mode's
    rules gone from every node after each switch, the held connections answered across both."""
    if lab.mode != "iptables":
        pytest.skip(
            "the iptables mode's lab switches both ways; the nftables lab covers nothing more"
        )
    lab.deploy_demo()
    original = _knit_config(lab)
    settings = yaml.safe_load(original)
    assert settings["mode"] == "iptables"
    runs = []
    try:
        for mode in ("nftables", "iptables"):
            config = original if mode == "iptables" else yaml.safe_dump({**settings, "mode": mode})
            change = f"switch to the {mode} mode"
            runs.append(_under_traffic(lab, tmp_path, change, partial(_restart_with, lab, config)))
            for name in lab.nodes:
                # the old mode's rules go once the new mode's first sync put its own in
                eventually(partial(_switched, lab, name, mode), 30, what=f"{name} on {mode} alone")
    finally:
        if _knit_config(lab) != original:
            _restart_with(lab, original)
    _no_request_failed(*runs)


def _node_state(lab: Lab, name: str) -> dict[str, object]:
    """What a node holds for its pods: address reservations, veths and rules, beside the
    addresses of the pods the API server places there."""
    node = lab.nodes[name]
    store = node.folder / "var/lib/cni/networks/knit"
    reserved = sorted(p.name for p in store.iterdir() if p.name[0].isdigit() or ":" in p.name)
    # pods' veths on knit's bridge (the node's own uplink is a veth too)
    veths = node.machine.run("ip", "-o", "link", "show", "master", "knit0").count("\n")
    ruleset = ["iptables-save"] if lab.mode == "iptables" else ["nft", "list", "ruleset"]
    pods = json.loads(
        lab.kubectl("get", "pods", "-A", "--field-selector", f"spec.nodeName={name}", "-o", "json")
    )["items"]
    addresses = [
        ip["ip"]
        for pod in pods
        if not pod["spec"].get("hostNetwork")
        for ip in pod["status"].get("podIPs", [])
    ]
    namespaces = json.loads(lab.kubectl("get", "namespaces", "-o", "json"))["items"]
    terminating = [item for item in pods + namespaces if item["metadata"].get("deletionTimestamp")]
    return {
        "reserved": reserved,
        "veths": veths,
        "rules": len(node.machine.run(*ruleset).splitlines()),
        "pod addresses": sorted(addresses),
        "terminating pods and namespaces": len(terminating),
    }


def _settled(lab: Lab, name: str) -> dict[str, object] | None:
    """The node's state once no pod on it and no namespace is terminating, its reservations
    are exactly its pods' addresses and nothing changed over two seconds (knit has programmed
    the Services just made). The pods of a namespace being deleted, by earlier specs, still
    hold their addresses and veths, so they would pass the other checks and then be missing
    from a later snapshot."""
    first = _node_state(lab, name)
    time.sleep(2)
    state = _node_state(lab, name)
    quiet = state == first and state["terminating pods and namespaces"] == 0
    return state if quiet and state["reserved"] == state["pod addresses"] else None


def test_knit_and_the_node_restarting_leak_nothing(lab: Lab) -> None:
    lab.deploy_demo()
    # the pods of specs run before this one may still be going away
    before = eventually(lambda: _settled(lab, "node3"), 240, what="node3's pods settled")
    assert before["veths"] == len(before["pod addresses"]) // 2  # one per dual-stack pod
    knit = lab.kubectl(
        "-n", "kube-system", "get", "pods", "-l", "app.kubernetes.io/name=knit",
        "--field-selector", "spec.nodeName=node3", "-o", "name",
    ).strip()  # fmt: skip
    lab.kubectl("-n", "kube-system", "delete", knit, "--timeout=60s", timeout=70)
    lab.kubectl(
        "-n", "kube-system", "rollout", "status", "daemonset/knit", "--timeout=180s", timeout=200
    )  # fmt: skip
    after_knit = eventually(lambda: _settled(lab, "node3"), 120, what="node3 settled")
    lab.nodes["node3"].restart(lab.plane_dir / "pki", lab.server)
    lab.wait_ready()
    lab.kubectl("wait", "--for=condition=Ready", "pods", "--all", "--timeout=120s", timeout=130)
    after_restart = eventually(lambda: _settled(lab, "node3"), 120, what="node3 settled")
    print(f"node3 before {before}, after knit's pod {after_knit}, after a restart {after_restart}")
    assert after_knit == before
    assert after_restart == before
