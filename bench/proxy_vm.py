"""knit-proxyd's IPVS mode beside kube-proxy's IPVS mode, measured by the proxy bench
(bench/proxy_bench.py, `--modes ipvs`) run whole inside a VM node (deploy/lab/vm.py): the
development kernel has no IPVS, Debian's does. Everything the bench starts runs in the VM
(etcd, kube-apiserver, both daemons, the loads and the connections), so each figure is set
only beside an anchor measured in the same VM in the same run; under TCG every one of them is
several times slower than on the host, and no figure of this run is comparable with a host's.

The bench's output is printed as it comes; its result file is copied out of the VM to
docs/results/ (or `--json`) and drawn as a chart there.

Run as root from the repository root (~1 hour at the default sizes, most of it at 10,000):
  .venv/bin/python -m bench.proxy_vm [--sizes 1000,10000] [--quick]
"""

from __future__ import annotations

import argparse
import time

from bench import chart, record
from deploy.lab.paths import BUILD
from deploy.lab.process import exit_on_termination
from deploy.lab.vm import PYTHON, VmNode, booted

RESULT = "/run/proxy-bench.json"
LOG = "/run/proxy-bench.log"
POLL = 5.0
"""Seconds between two reads of the bench's output in the VM."""


def follow(vm: VmNode, argv: list[str], env: dict[str, str]) -> int:
    """Run argv in the VM, printing its output as it grows; its exit code."""
    process = vm.spawn(argv, LOG, env)
    printed = 0
    while True:
        code = process.poll()
        grown = vm.run("tail", "-c", f"+{printed + 1}", LOG).stdout
        print(grown, end="", flush=True)
        printed += len(grown.encode())
        if code is not None:
            return code
        time.sleep(POLL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1000,10000", help="numbers of services, e.g. 1000")
    parser.add_argument("--quick", action="store_true", help="fewer repeats, shorter loads")
    parser.add_argument("--cpus", type=int, default=2, help="the VM's CPUs")
    parser.add_argument("--memory-mib", type=int, default=8192, help="the VM's memory")
    record.add_json_option(parser)
    options = parser.parse_args()
    exit_on_termination()
    argv = [PYTHON, "-m", "bench.proxy_bench", "--modes", "ipvs", "--sizes", options.sizes]
    argv += ["--json", RESULT, "--no-chart", *(["--quick"] if options.quick else [])]
    env = {record.REVISION_VARIABLE: record.revision()}
    folder = BUILD / "vm" / f"proxy-bench-{time.strftime('%Y%m%d-%H%M%S')}"
    with booted(folder, memory_mib=options.memory_mib, cpus=options.cpus) as vm:
        print(f"VM ready in {vm.boot_seconds:.1f} s ({options.cpus} CPUs under TCG)", flush=True)
        code = follow(vm, argv, env)
        if code != 0:
            raise SystemExit(f"the bench failed in the VM ({code}); console: {vm.console}")
        figures = vm.run("cat", RESULT).stdout
    variant = ["ipvs-vm"]
    if options.sizes != "1000,10000":
        variant.append("sizes-" + options.sizes.replace(",", "-"))
    if options.quick:
        variant.append("quick")
    path = record.result_path(options.json, "proxy", "-".join(variant))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(figures)
    print(f"figures copied to {path}")
    chart.draw(path, path.with_suffix(".png"))


if __name__ == "__main__":
    main()
