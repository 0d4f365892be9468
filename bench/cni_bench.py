"""ADD, CHECK and DEL per pod through libcni: the reference bridge + host-local, knit in-process
and knit through the node daemon's fast path, side by side.

All three run with the same settings (a gateway bridge each, host-local over a /24, one veth
per pod) in one node namespace, on the same pod namespaces, alternating rounds. The node holds
kubelet's iptables hint chain, as kubelet makes it on every node. The fast path's
daemon (cni.server) runs inside the node namespace. Prints the medians, the ratio against the
reference (1.0 = as fast, above 1 = slower), and where the fast path's time goes: the
daemon's work (from its log) against the rest (the client and the transport), the client alone
against a daemon that answers at once, and the daemon's work by step (bench.cni_steps).

Run as root, from the checkout: .venv/bin/python -m bench.cni_bench [--pods 20] [--rounds 3]
[--ip-masq] [--nat-rules N] [--node-addresses N]. --ip-masq: every contender masquerades its pods'
outgoing traffic, so ADD, CHECK and DEL also write, verify and remove those rules, knit and the
reference both through iptables. --nat-rules: the node's nat table first holds N other rules,
as kube-proxy's iptables mode fills it, 8 to a chain.
--node-addresses: a link of the node first holds N other addresses, as IPVS mode's dummy
device holds service addresses.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import record
from cni.server import encode_response, read_request
from deploy.lab.paths import CNIDRIVER, REFERENCE_PLUGINS, ROOT
from deploy.lab.process import exit_on_termination

PREFIX = f"kb{os.getpid()}"
VERBS = ("add", "check", "del")
CONTENDERS = ("reference", "knit", "knit-fast")
SERVER = """
import logging, sys
logging.basicConfig(level=logging.INFO, format="%(message)s")
from cni.server import serve
server = serve(sys.argv[1])
print("ready", flush=True)
sys.stdin.read()
server.close()
"""
SERVED = re.compile(r"^CNI (?P<verb>[A-Z]+) \S+: exit 0 in (?P<ms>[\d.]+) ms$")


def sh(*argv: str, stdin: str | None = None) -> str:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, check=True).stdout


def build_launcher(directory: Path, socket_path: str = "") -> Path:
    """The Makefile's `knit`, built into directory/cni, its launch file naming the socket."""
    target = directory / "cni" / "knit"
    make = ["make", "-s", "-C", str(ROOT), "-o", "venv", f"BUILD={directory}"]
    sh(*make, f"CNI_SOCKET={socket_path}", str(target), str(target.parent / "knit.d" / "launch"))
    return target.parent


def conflist(
    plugin_type: str, bridge: str, subnet: str, data_dir: Path, ip_masq: bool
) -> dict[str, Any]:
    return {
        "cniVersion": "1.1.0",
        "name": f"bench-{bridge}",
        "plugins": [
            {
                "type": plugin_type,
                "bridge": bridge,
                "isGateway": True,
                "ipMasq": ip_masq,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": subnet}]],
                    "dataDir": str(data_dir),
                },
            }
        ],
    }


def fill_nat(node: str, rules: int) -> None:
    """N DNAT rules, 8 to a chain, in the node's nat table."""
    chains = range((rules + 7) // 8)
    lines = ["*nat", *(f":KUBE-SEP-BENCH{c:06d} - [0:0]" for c in chains)]
    lines += [
        f"-A KUBE-SEP-BENCH{i // 8:06d} -p tcp -m comment --comment bench/svc-{i // 8}"
        f" -j DNAT --to-destination 10.244.{i % 8}.{i % 250}:80"
        for i in range(rules)
    ]
    lines += ["COMMIT", ""]
    sh("ip", "netns", "exec", node, "iptables-nft-restore", "--noflush", stdin="\n".join(lines))


def add_kubelet_hint(node: str) -> None:
    """The chain kubelet makes in mangle at start (pkg/kubelet/kubelet_network_linux.go) to
    tell the node's other programs which iptables flavour it uses, here nft."""
    sh("ip", "netns", "exec", node, "iptables-nft", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT")


def add_node_addresses(node: str, count: int) -> None:
    """count /32 addresses on a veth of the node's own (a stand-in for IPVS's dummy device)."""
    sh("ip", "-n", node, "link", "add", "name", "kb-svc", "type", "veth", "peer", "name", "kb-svc1")
    batch = "".join(
        f"addr add 10.{96 + i // 62500}.{i // 250 % 250}.{i % 250 + 1}/32 dev kb-svc\n"
        for i in range(count)
    )
    sh("ip", "-n", node, "-batch", "-", stdin=batch)


def run_driver(
    node: str, work: Path, name: str, conf: dict[str, Any], cni_path: str
) -> dict[str, list[float]]:
    """The driver's seconds per call, by verb."""
    path = work / f"{name}.conflist"
    path.write_text(json.dumps(conf))
    files = ["--conflist", str(path), "--cache-dir", str(work / "cache")]
    files += ["--netns-list", str(work / "netns")]
    out = sh("ip", "netns", "exec", node, str(CNIDRIVER), "bench", *files, "--cni-path", cni_path)
    times: dict[str, list[float]] = json.loads(out)
    return times


@contextmanager
def fast_path_server(node: str, socket_path: Path) -> Iterator[dict[str, list[float]]]:
    """cni.server inside the node namespace; yields the daemon's own time per verb (seconds),
    filled in from its log when it stops."""
    proc = subprocess.Popen(
        ["ip", "netns", "exec", node, sys.executable, "-c", SERVER, str(socket_path)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    served: dict[str, list[float]] = {}
    try:
        yield served
    finally:
        _, log = proc.communicate("", timeout=30)
    for line in log.splitlines():
        if match := SERVED.match(line):
            served.setdefault(match["verb"].lower(), []).append(float(match["ms"]) / 1000)


def startup_breakdown(launcher_dir: Path) -> dict[str, float]:
    """Median seconds: a bare interpreter (-I -S), and the plugin answering VERSION in-process
    (interpreter + the plugin's modules)."""
    env = {"CNI_COMMAND": "VERSION", "PATH": os.environ["PATH"]}
    bare, version = [], []
    for _ in range(10):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True)
        bare.append(time.perf_counter() - start)
        start = time.perf_counter()
        subprocess.run(
            [launcher_dir / "knit"], input=b"{}", env=env, capture_output=True, check=True
        )
        version.append(time.perf_counter() - start)
    return {"interpreter": statistics.median(bare), "version_call": statistics.median(version)}


def client_alone(directory: Path, calls: int = 50) -> float:
    """Median seconds of a DEL through the compiled client to a daemon that answers at once:
    the fast path's cost outside the daemon's work (exec, connect, transport, print)."""
    socket_path = directory / "answering.sock"
    client = build_launcher(directory, str(socket_path)) / "knit"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(socket_path))
    listener.listen(calls)

    def answer() -> None:
        for _ in range(calls):
            connection, _ = listener.accept()
            with connection:
                read_request(connection).close()
                connection.sendall(encode_response(0, b""))

    answering = threading.Thread(target=answer, daemon=True)
    answering.start()
    env = {"CNI_COMMAND": "DEL", "CNI_CONTAINERID": "c", "CNI_IFNAME": "eth0"}
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        subprocess.run([client], input=b"{}", env=env, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    answering.join(10)
    listener.close()
    return statistics.median(times)


def daemon_steps(node: str, conf: dict[str, Any], pods: list[str]) -> dict[str, dict[str, float]]:
    """bench.cni_steps in the node namespace: the daemon's work per verb by step (ms)."""
    plugin = {**conf["plugins"][0], "cniVersion": conf["cniVersion"], "name": conf["name"]}
    argv = [sys.executable, "-m", "bench.cni_steps", json.dumps(plugin), *pods]
    out = subprocess.run(
        ["ip", "netns", "exec", node, *argv], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    steps: dict[str, dict[str, float]] = json.loads(out)
    return steps


def figures(
    samples: dict[str, dict[str, list[float]]],
    served: dict[str, list[float]],
    breakdown: dict[str, float],
) -> list[dict[str, object]]:
    """One figure per verb: each contender's median ms, knit's ratios to the reference, and
    the fast path's daemon work; then where a call's start-up time goes."""
    rows: list[dict[str, object]] = []
    for verb in VERBS:
        ms = {name: statistics.median(samples[name][verb]) * 1000 for name in CONTENDERS}
        daemon = statistics.median(served[verb]) * 1000 if served.get(verb) else None
        rows.append(
            {
                "verb": verb.upper(),
                "reference_ms": round(ms["reference"], 1),
                "knit_ms": round(ms["knit"], 1),
                "knit_ratio": round(ms["knit"] / ms["reference"], 2),
                "knit_fast_ms": round(ms["knit-fast"], 1),
                "knit_fast_ratio": round(ms["knit-fast"] / ms["reference"], 2),
                "knit_fast_daemon_ms": None if daemon is None else round(daemon, 1),
                "knit_fast_rest_ms": None if daemon is None else round(ms["knit-fast"] - daemon, 1),
            }
        )
    rows.append({name: round(seconds * 1000, 1) for name, seconds in breakdown.items()})
    return rows


def report(options: argparse.Namespace, rows: list[dict[str, object]]) -> None:
    settings = ", ipMasq" if options.ip_masq else ""
    if options.nat_rules:
        settings += f", {options.nat_rules} other nat rules"
    if options.node_addresses:
        settings += f", {options.node_addresses} other node addresses"
    rounds = f"{options.pods} pods x {options.rounds} rounds"
    print(f"{rounds} via libcni{settings} (median ms per call)")
    print(f"{'verb':6} {'reference':>10} {'knit':>8} {'ratio':>6} {'knit-fast':>10} {'ratio':>6}")
    *verbs, breakdown = rows
    for row in verbs:
        print(
            f"{row['verb']:6} {row['reference_ms']:10} {row['knit_ms']:8} {row['knit_ratio']:6}"
            f" {row['knit_fast_ms']:10} {row['knit_fast_ratio']:6}"
        )
    print("fast path, median ms: call through libcni = daemon's work + the rest")
    for row in verbs:
        print(
            f"  {row['verb']:6} {row['knit_fast_ms']} = {row['knit_fast_daemon_ms']}"
            f" + {row['knit_fast_rest_ms']}"
        )
    print(f"  the client alone, to a daemon answering at once: {breakdown['client_alone']} ms")
    print(
        f"bare interpreter (-I -S): {breakdown['interpreter']} ms; in-process "
        f"VERSION call (interpreter + plugin modules): {breakdown['version_call']} ms"
    )


def report_steps(steps: dict[str, dict[str, float]]) -> None:
    print("the daemon's work by step (cni.plugin.execute in the node namespace), median ms:")
    for verb, by_step in steps.items():
        listed = ", ".join(
            f"{label} {ms}"
            for label, ms in sorted(by_step.items(), key=lambda item: -item[1])
            if label != "total"
        )
        print(f"  {verb} {by_step['total']}: {listed}")


def variant(options: argparse.Namespace) -> str:
    """The part of the result file's name saying how the run differs from the default one."""
    parts = ["ip-masq"] if options.ip_masq else []
    if options.nat_rules:
        parts.append(f"nat-rules-{options.nat_rules}")
    if options.node_addresses:
        parts.append(f"node-addresses-{options.node_addresses}")
    if (options.pods, options.rounds) != (20, 3):
        parts.append(f"pods-{options.pods}x{options.rounds}")
    return "-".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ip-masq", action="store_true")
    parser.add_argument("--nat-rules", type=int, default=0)
    parser.add_argument("--node-addresses", type=int, default=0)
    record.add_json_option(parser)
    options = parser.parse_args()
    began_at = record.revision()
    exit_on_termination()
    node = f"{PREFIX}-node"
    pods = [f"{PREFIX}-pod{i}" for i in range(options.pods)]
    samples: dict[str, dict[str, list[float]]] = {name: {} for name in CONTENDERS}
    with tempfile.TemporaryDirectory(prefix="knit-bench-") as tmp:
        work = Path(tmp)
        socket_path = work / "run" / "cni.sock"
        plain = build_launcher(work / "plain")
        fast = build_launcher(work / "fast", str(socket_path))
        (work / "netns").write_text("".join(f"/var/run/netns/{p}\n" for p in pods))
        masq = options.ip_masq
        confs = {
            "reference": conflist("bridge", "kbr1", "10.251.0.0/24", work / "ipam-ref", masq),
            "knit": conflist("knit", "kbr0", "10.250.0.0/24", work / "ipam-knit", masq),
            "knit-fast": conflist("knit", "kbr2", "10.252.0.0/24", work / "ipam-fast", masq),
        }
        launchers = {"reference": "", "knit": plain, "knit-fast": fast}
        try:
            for ns in [node, *pods]:
                sh("ip", "netns", "add", ns)
            add_kubelet_hint(node)
            if options.nat_rules:
                fill_nat(node, options.nat_rules)
            if options.node_addresses:
                add_node_addresses(node, options.node_addresses)
            with fast_path_server(node, socket_path) as served:
                for _ in range(options.rounds):
                    for name, conf in confs.items():
                        plugin_dir = launchers[name]
                        cni_path = (
                            f"{plugin_dir}:{REFERENCE_PLUGINS}"
                            if plugin_dir
                            else str(REFERENCE_PLUGINS)
                        )
                        for verb, times in run_driver(node, work, name, conf, cni_path).items():
                            samples[name].setdefault(verb, []).extend(times)
            steps = daemon_steps(node, confs["knit-fast"], pods)
        finally:
            for ns in [node, *pods]:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        breakdown = startup_breakdown(plain)
        breakdown["client_alone"] = client_alone(work / "answering")
    rows = figures(samples, served, breakdown)
    report(options, rows)
    report_steps(steps)
    rows.append({"daemon_steps_ms": steps})
    record.write(record.result_path(options.json, "cni", variant(options)), rows, began_at)


if __name__ == "__main__":
    main()
