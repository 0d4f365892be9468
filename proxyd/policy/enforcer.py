"""Keeps each family's `knit-policy` table equal to what the policies want: the only part of
policy enforcement that talks to the kernel.

The first sync, and the first after a failure, writes the whole table in one transaction;
the others change only what differs from what was last written (set and map elements, the
chains of pods whose rules changed). Syncs run on their own thread, so a policy change never
waits for a proxy sync, nor the reverse, and without the proxy's --min-sync-period: a sync
costs what changed (about a millisecond for a pod's change), and the changes that arrive
while one runs are taken together by the next.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable

from proxyd import gc_pause
from proxyd.metrics import Metrics
from proxyd.nftables.kernel import Nft, counter_packets
from proxyd.policy.compile import Cluster, FamilyCompiler, FamilyPolicy, PodKey
from proxyd.policy.denials import DenialLog
from proxyd.policy.render import TABLE, Renderer
from proxyd.policy.state import PolicyState
from proxyd.runner import BoundedFrequencyRunner

log = logging.getLogger(__name__)

DeniedKey = tuple[str, str, str]
"""(direction, namespace, the names of the policies judging the pod, joined by commas)."""


class PolicyEnforcer:
    def __init__(
        self,
        node_name: str,
        families: Iterable[int],
        sync_period: float,
        metrics: Metrics,
        log_rate: int = 0,
    ) -> None:
        """`log_rate`: denied packets logged per second and family (0: none)."""
        self.families = tuple(families)
        self.metrics = metrics
        self.denial_log = DenialLog(self.describe) if log_rate else None
        self.runner = BoundedFrequencyRunner(self.sync, 0.0, sync_period)
        self.state = PolicyState(node_name, on_change=self.runner.run)
        self._nft = {family: Nft(family, TABLE) for family in self.families}
        self._renderers = {family: Renderer(family, log_rate) for family in self.families}
        self._compilers = {family: FamilyCompiler(family) for family in self.families}
        self._written: dict[int, FamilyPolicy | None] = dict.fromkeys(self.families)

    def sync(self) -> None:
        if not self.state.ready():
            log.debug("waiting for the first lists of the objects policies depend on")
            return
        start, cpu_at_start = time.monotonic(), time.thread_time()
        in_kernel = 0.0
        cluster, changed_pods = self.state.take()
        # a full compile allocates an object per pod and set element: see gc_pause
        with gc_pause.paused():
            for family in self.families:
                in_kernel += self._sync_family(family, cluster, changed_pods)
        elapsed, cpu = time.monotonic() - start, time.thread_time() - cpu_at_start
        self.metrics.policy_sync_duration.observe(elapsed)
        # CPU time beside wall time: a sync that waited for the CPU or the GIL (other threads
        # work too after a start) shows as wall time without CPU time
        log.info(
            "policy sync: %d policies, %d cluster policies, %d pods in %.1f ms "
            "(%.1f ms of it loading nft; %.1f ms of CPU)",
            len(cluster.policies),
            len(cluster.cluster_policies),
            len(cluster.pods),
            elapsed * 1000,
            in_kernel * 1000,
            cpu * 1000,
        )

    def _sync_family(
        self, family: int, cluster: Cluster, changed_pods: set[PodKey] | None
    ) -> float:
        """Bring one family's table to what the cluster wants; the seconds spent loading it."""
        written = self._written[family]
        # after a failure, nothing the compiler kept is trusted
        changed = changed_pods if written is not None else None
        try:
            wanted = self._compilers[family].compile(cluster, changed)
            renderer = self._renderers[family]
            transaction = (
                renderer.full(wanted, replacing=self._nft[family].exists())
                if written is None
                else renderer.partial(written, wanted)
            )
            began = time.monotonic()
            self._nft[family].run(transaction)
            loading = time.monotonic() - began
        except Exception:
            log.exception("IPv%d policy sync failed; the whole table is written next", family)
            self._written[family] = None
            self.runner.retry_after(1.0)
            return 0.0
        self._written[family] = wanted
        return loading

    def denied(self) -> Counter[DeniedKey]:
        """Packets the pod chains dropped, by what denied them, read from the kernel's
        counters."""
        totals: Counter[DeniedKey] = Counter()
        for family in self.families:
            written = self._written[family]
            if written is None:
                continue
            for chain, packets in counter_packets(family, TABLE).items():
                owner = written.owners.get(chain)
                if owner is not None:
                    direction = "ingress" if chain.startswith("ingress") else "egress"
                    policies = ",".join(sorted(written.isolating[chain]))
                    totals[direction, owner[0], policies] += packets
        return totals

    def describe(self, chain: str) -> str | None:
        """The pod a pod chain is for and the policies judging it, in words; None when no
        family's table has that chain now."""
        for written in self._written.values():
            if written is not None and chain in written.owners:
                namespace, name = written.owners[chain]
                policies = ", ".join(sorted(written.isolating[chain]))
                return f"{namespace}/{name} (judged by {policies})"
        return None

    def start(self) -> threading.Thread:
        """Sync from now on, on a thread of its own; the nft contexts open here, while the
        watches list, rather than in the first sync."""
        for nft in self._nft.values():
            nft.open()
        self.metrics.count_denied(self.denied)
        if self.denial_log is not None:
            self.denial_log.start()
        thread = threading.Thread(target=self.runner.loop, name="policy-sync", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.runner.stop()

    def cleanup(self) -> int:
        """Delete the policy tables; returns how many existed."""
        return sum(self._nft[family].delete_table() for family in self.families)
