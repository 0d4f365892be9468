"""The service proxies the proxy bench measures, each in a node namespace: knit-proxyd, and the
real kube-proxy beside it. Both serve kube-proxy's metric names, so one reader serves both;
what differs is how each is started and the lines its log holds after a sync."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.proxy_netns import in_netns
from deploy.lab.kube_proxy_node import kube_proxy_config, launch_kube_proxy
from deploy.lab.netns import Netns
from deploy.lab.process import eventually
from deploy.lab.proxyd_node import launch_proxyd

KNIT = "knit-proxyd"
KUBE_PROXY = "kube-proxy"
METRICS_ADDRESS = "127.0.0.1:10249"
FULL = "kubeproxy_sync_full_proxy_rules_duration_seconds"
PARTIAL = "kubeproxy_sync_partial_proxy_rules_duration_seconds"
SYNC = "kubeproxy_sync_proxy_rules_duration_seconds"
"""Every sync, full or partial: the only sync metric of kube-proxy's IPVS mode, whose syncs
are all full."""
LAST_SYNC = "kubeproxy_sync_proxy_rules_last_timestamp_seconds"
PROGRAMMING = "kubeproxy_network_programming_duration_seconds"
"""From an EndpointSlice's last-change-trigger-time annotation to its rules in the kernel: the
bench's changes set that annotation to the time of their PATCH, as the EndpointSlice controller
does for a change it makes."""
PENDING = "kubeproxy_sync_proxy_rules_endpoint_changes_pending"
TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
IP_FAMILY_LABEL = re.compile(r'ip_family="(IPv[46])",?')
"""Both families' parts of one sync are read as one: their times summed (`_sum`), the rest
(sync counts, timestamps) the larger of the two; each family's value is kept too, as
`NAME@IPvN`."""
KNIT_SYNCS = {
    FULL: [re.compile(r"knit-proxyd: full sync of ")],
    PARTIAL: [re.compile(r"knit-proxyd: partial sync of [1-9]")],
}
"""The line knit-proxyd logs after each kind of sync (Daemon._sync_changes in
proxyd/daemon.py); a partial sync of changed services, not one of the periodic syncs."""
KUBE_PROXY_SYNCS = {
    FULL: [
        re.compile(
            rf'"Syncing \w+ rules" ipFamily="IPv{family}" fullSync=true'
            rf'.*?"SyncProxyRules complete" ipFamily="IPv{family}"',
            re.S,
        )
        for family in (4, 6)
    ],
    PARTIAL: [re.compile(r'"SyncProxyRules complete" ipFamily="IPv4"')],
}
"""kube-proxy's lines at -v=2 (pkg/proxy/{iptables,nftables}/proxier.go): each family's
proxier syncs on its own; a full sync ends when both did one. Its periodic syncs look like any
partial one, so a change's sync is told by the network programming count (wait_sync).
Its IPVS mode logs the end of a sync only at -v=4, with a line per virtual server besides:
there each family's sync count tells a sync has ended."""
BY_METRIC: dict[str, list[re.Pattern[str]]] = {FULL: [], PARTIAL: []}


@dataclass
class Daemon:
    """A service proxy in a node namespace."""

    program: str
    ns: Netns
    process: subprocess.Popen[bytes]
    log: Path
    started: float
    """time.time() just before the launch."""
    syncs: dict[str, list[re.Pattern[str]]]
    """Per kind of sync, what the log holds past a point once one ended there."""
    args: list[str]
    """knit-proxyd's flags (empty for kube-proxy)."""
    sync_metrics: dict[str, str] = field(default_factory=lambda: {FULL: FULL, PARTIAL: PARTIAL})
    """The metric each kind of sync is measured by."""

    @classmethod
    def knit(cls, ns: Netns, args: list[str], log: Path, profile: Path | None) -> Daemon:
        python = ["-m", "cProfile", "-o", str(profile)] if profile else []
        started = time.time()
        process = launch_proxyd(ns, args, log, *python)
        return cls(KNIT, ns, process, log, started, KNIT_SYNCS, args)

    @classmethod
    def kube_proxy(
        cls, ns: Netns, kubeconfig: Path, node: str, cluster_cidr: str, mode: str, folder: Path
    ) -> Daemon:
        config = kube_proxy_config(kubeconfig, node, cluster_cidr, mode, METRICS_ADDRESS)
        log = folder / "kube-proxy.log"
        started = time.time()
        process = launch_kube_proxy(ns, config, folder, log)
        if mode == "ipvs":
            by_metric = {FULL: SYNC, PARTIAL: SYNC}
            return cls(KUBE_PROXY, ns, process, log, started, BY_METRIC, [], by_metric)
        return cls(KUBE_PROXY, ns, process, log, started, KUBE_PROXY_SYNCS, [])

    def metrics(self) -> dict[str, float]:
        if self.process.poll() is not None:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
            raise RuntimeError(f"{self.program} exited with {self.process.returncode}:\n{tail}")
        body = in_netns(self.ns, _metrics_page)
        values: dict[str, float] = {}
        for line in body.splitlines():
            if line and not line.startswith("#"):
                labelled, _, text = line.rpartition(" ")
                key, value = IP_FAMILY_LABEL.sub("", labelled).replace("{}", ""), float(text)
                if family := IP_FAMILY_LABEL.search(labelled):
                    values[f"{key}@{family[1]}"] = value
                if key in values:
                    value = values[key] + value if key.endswith("_sum") else max(values[key], value)
                values[key] = value
        return values

    def log_size(self) -> int:
        return self.log.stat().st_size

    def wait_sync(
        self,
        kind: str,
        since: int,
        timeout: float,
        change: dict[str, float] | None = None,
        before: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """The metrics once the log showed, past byte `since`, a full sync (FULL) or a partial
        sync (PARTIAL); with `change` (the metrics before a change was made), the sync that
        programmed it: the network programming count grew. TimeoutError when none did within
        timeout. The log costs the daemon nothing to watch, where each look at its metrics is
        a request it serves (in knit-proxyd, a turn of its metrics thread at the GIL) during
        the sync being measured: metrics are read once the log says so.
        A daemon whose log does not say (kube-proxy's IPVS mode) has synced once every
        family's count of the kind's metric grew past `change` or `before` (None: at start)."""
        patterns = self.syncs[kind]
        start = since
        result: dict[str, float] = {}
        count = f"{self.sync_metrics[kind]}_count@"
        counted = change if change is not None else (before or {})

        def synced() -> bool:
            nonlocal start
            with self.log.open("rb") as log:
                log.seek(start)
                text = log.read().decode(errors="replace")
            if not all(pattern.search(text) for pattern in patterns):
                return False
            metrics = self.metrics()
            counts = [f"{count}IPv{family}" for family in (4, 6)]
            if not patterns and any(metrics.get(k, 0.0) <= counted.get(k, 0.0) for k in counts):
                return False
            if change is not None and metrics.get(f"{PROGRAMMING}_count", 0.0) <= change.get(
                f"{PROGRAMMING}_count", 0.0
            ):
                start += len(text.encode())  # a sync before the change was seen
                return False
            result.update(metrics)
            return True

        what = f"{self.program}: a sync logged as {[p.pattern for p in patterns]} or counted"
        # a look at the metrics is a request the daemon serves: seldom, when only they tell
        eventually(synced, timeout, what, 0.05 if patterns else 0.5)
        return result

    def spent(self, after: dict[str, float], before: dict[str, float], kind: str) -> float:
        """Seconds the daemon spent in syncs of the kind between the two readings."""
        return spent(after, before, self.sync_metrics[kind])

    def memory_mib(self) -> tuple[float, float]:
        """(VmRSS, VmHWM); `ip netns exec` execs the program, so the pid is the same."""
        status = self._proc("status")
        fields = dict(line.split(":", 1) for line in status.splitlines())
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024

    def cpu_seconds(self) -> float:
        """User and system time the process has spent so far, all its threads."""
        stat = self._proc("stat")
        utime, stime = stat.rpartition(")")[2].split()[11:13]
        return (int(utime) + int(stime)) / os.sysconf("SC_CLK_TCK")

    def _proc(self, name: str) -> str:
        marker = b"proxyd" if self.program == KNIT else self.program.encode()
        assert marker in Path(f"/proc/{self.process.pid}/cmdline").read_bytes()
        return Path(f"/proc/{self.process.pid}/{name}").read_text()

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _metrics_page() -> str:
    """The metrics page at METRICS_ADDRESS, as the calling thread's namespace reaches it; empty
    when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{METRICS_ADDRESS}/metrics", timeout=10) as page:
            body: bytes = page.read()
            return body.decode()
    except OSError:
        return ""


def spent(after: dict[str, float], before: dict[str, float], kind: str) -> float:
    return after[f"{kind}_sum"] - before.get(f"{kind}_sum", 0.0)


def programming(after: dict[str, float], before: dict[str, float]) -> float:
    """The mean network programming latency of the changes a sync programmed, in seconds."""
    count = after[f"{PROGRAMMING}_count"] - before.get(f"{PROGRAMMING}_count", 0.0)
    return spent(after, before, PROGRAMMING) / count
