"""ADD, CHECK and DEL per pod through libcni: knit against the reference bridge + host-local.

Both run with the same settings (a gateway bridge, host-local over a /24, one veth per pod)
in one node namespace, on the same pod namespaces, alternating rounds. Prints the medians,
the ratio knit/reference (1.0 = as fast, above 1 = slower), and where knit's time goes.

Run as root: .venv/bin/python bench/cni_bench.py [--pods 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "build" / "tools" / "cnidriver"
KNIT_DIR = ROOT / "build" / "cni"
REFERENCE_DIR = ROOT / "build" / "refcni"
PREFIX = f"kb{os.getpid()}"


def sh(*argv: str, stdin: str | None = None) -> str:
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, check=True).stdout


def conflist(plugin_type: str, bridge: str, subnet: str, data_dir: Path) -> dict:
    return {
        "cniVersion": "1.1.0",
        "name": f"bench-{plugin_type}",
        "plugins": [
            {
                "type": plugin_type,
                "bridge": bridge,
                "isGateway": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": subnet}]],
                    "dataDir": str(data_dir),
                },
            }
        ],
    }


def run_driver(node: str, work: Path, name: str, conf: dict, netns_list: Path) -> dict:
    path = work / f"{name}.conflist"
    path.write_text(json.dumps(conf))
    out = sh(
        "ip",
        "netns",
        "exec",
        node,
        str(DRIVER),
        "bench",
        "--conflist",
        str(path),
        "--cni-path",
        f"{KNIT_DIR}:{REFERENCE_DIR}",
        "--cache-dir",
        str(work / "cache"),
        "--netns-list",
        str(netns_list),
    )
    return json.loads(out)


def startup_breakdown() -> dict[str, float]:
    """Median seconds for: the plugin answering VERSION (interpreter + our modules), and
    importing pyroute2's IPRoute in the same interpreter."""
    launcher = str(KNIT_DIR / "knit")
    env = {"CNI_COMMAND": "VERSION", "PATH": os.environ["PATH"]}
    version_times, import_times = [], []
    for _ in range(10):
        start = time.perf_counter()
        subprocess.run([launcher], input=b"{}", env=env, capture_output=True, check=True)
        version_times.append(time.perf_counter() - start)
        code = (
            "import time; t = time.perf_counter(); from pyroute2 import IPRoute; "
            "print(time.perf_counter() - t)"
        )
        import_times.append(float(sh(sys.executable, "-I", "-c", code)))
    return {
        "version_call": statistics.median(version_times),
        "pyroute2_import": statistics.median(import_times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    options = parser.parse_args()
    node = f"{PREFIX}-node"
    pods = [f"{PREFIX}-pod{i}" for i in range(options.pods)]
    samples: dict[str, dict[str, list[float]]] = {"knit": {}, "reference": {}}
    with tempfile.TemporaryDirectory(prefix="knit-bench-") as tmp:
        work = Path(tmp)
        try:
            for ns in [node, *pods]:
                sh("ip", "netns", "add", ns)
            netns_list = work / "netns"
            netns_list.write_text("".join(f"/var/run/netns/{p}\n" for p in pods))
            contenders = {
                "knit": conflist("knit", "kbr0", "10.250.0.0/24", work / "ipam-knit"),
                "reference": conflist("bridge", "kbr1", "10.251.0.0/24", work / "ipam-ref"),
            }
            for _ in range(options.rounds):
                for name, conf in contenders.items():
                    for verb, times in run_driver(node, work, name, conf, netns_list).items():
                        samples[name].setdefault(verb, []).extend(times)
        finally:
            for ns in [node, *pods]:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
    print(f"{options.pods} pods x {options.rounds} rounds through libcni (median ms per call)")
    print(f"{'verb':6} {'knit':>8} {'reference':>10} {'ratio':>7}")
    for verb in ("add", "check", "del"):
        ours = statistics.median(samples["knit"][verb]) * 1000
        ref = statistics.median(samples["reference"][verb]) * 1000
        print(f"{verb:6} {ours:8.1f} {ref:10.1f} {ours / ref:7.2f}")
    breakdown = startup_breakdown()
    print(
        f"knit VERSION call (interpreter + plugin modules): "
        f"{breakdown['version_call'] * 1000:.1f} ms; importing pyroute2: "
        f"{breakdown['pyroute2_import'] * 1000:.1f} ms"
    )


if __name__ == "__main__":
    main()
