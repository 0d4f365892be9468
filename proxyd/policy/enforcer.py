"""Keeps each family's `knit-policy` table equal to what the policies want: the only part of
policy enforcement that talks to the kernel.

The first sync, and the first after a failure, writes the whole table in one transaction;
the others change only what differs from what was last written (set and map elements, the
chains of pods whose rules changed). When nft refuses a whole table, the pods whose rules it
refuses are found and quarantined (quarantine.py), and the table is written without their
rules; a table nft refuses even so is tried again later and later, and the node's health says
so. Syncs run on their own thread, so a policy change never
waits for a proxy sync, nor the reverse, and without the proxy's --min-sync-period: a sync
costs what changed (about a millisecond for a pod's change), and the changes that arrive
while one runs are taken together by the next. Each family's transaction is loaded by a thread
of its own (ctypes lets go of the GIL) while the sync compiles the next family.

Staged policies are never in the table as policies (the compiler leaves them out). With flow
records on and a policy staged, each sync also compiles the staged view (staged.py), which
resolves what the staged policies would do with each record, and the table gets a chain that
only allows for each pod only staged policies select, to log its connections in. Without a
staged policy, neither is made.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from cni.kernel.nftables import NftError
from proxyd import gc_pause
from proxyd.containment import Held, refused
from proxyd.health import PolicyHealth
from proxyd.metrics import Metrics, family_label
from proxyd.nftables.kernel import Nft, counter_packets
from proxyd.policy.compile import Cluster, FamilyCompiler, FamilyPolicy, PodKey
from proxyd.policy.cutter import CUT, ConnectionCutter
from proxyd.policy.flowlog import LOST, logging_for
from proxyd.policy.model import Pod
from proxyd.policy.quarantine import quarantined, signature, subset
from proxyd.policy.recorder import Recorder
from proxyd.policy.render import TABLE, Renderer
from proxyd.policy.staged import observed
from proxyd.policy.state import PolicyState
from proxyd.runner import BoundedFrequencyRunner, backoff

log = logging.getLogger(__name__)


ADMISSION_WAIT = 5.0
"""How long a CNI ADD waits for the sync writing its pod's isolation: a sync of a pod's change
takes milliseconds, one after a start seconds."""
ADMISSION_POLL = 0.02
"""How often an ADD whose pod the API does not know yet looks for it again."""

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
        existing_connections: str = CUT,
        flow_rate: int = 0,
    ) -> None:
        """`log_rate`: denied packets logged per second and family (0: none);
        `existing_connections`: what a change does to the open connections it denies (CUT or
        KEEP, see cutter.py); `flow_rate`: connections recorded per second and family, with
        the rule that decided each (0: none), which compiles every match with its origin
        (docs/observability.md#flows: under 1% more time and memory)."""
        self.families = tuple(families)
        self.metrics = metrics
        self.cutter = ConnectionCutter(metrics) if existing_connections == CUT else None
        logged = logging_for(flow_rate, log_rate)
        self.recorder = (
            Recorder(node_name, self.table, metrics, bool(flow_rate), log_rate)
            if logged is not None
            else None
        )
        self._cluster: Cluster | None = None
        """The snapshot the last sync compiled, whose pods flow records are named by."""
        self.runner = BoundedFrequencyRunner(self.sync, 0.0, sync_period)
        self.state = PolicyState(node_name, on_change=self.runner.run)
        self._nft = {family: Nft(family, TABLE) for family in self.families}
        self._renderers = {family: Renderer(family, logged) for family in self.families}
        self._compilers = {
            family: FamilyCompiler(family, provenance=bool(flow_rate)) for family in self.families
        }
        self._records = bool(flow_rate)
        self._view_compilers: dict[int, FamilyCompiler] = {}
        """Per family, the staged view's compiler, while flow records are on and a policy is
        staged (dropped with its peer sets when none is)."""
        self._written: dict[int, FamilyPolicy | None] = dict.fromkeys(self.families)
        self._views: dict[int, tuple[FamilyPolicy, FamilyPolicy]] = {}
        """Per family, the table written and the staged view compiled with it, while a
        policy is staged."""
        self._in_kernel: dict[int, bool | None] = dict.fromkeys(self.families)
        """Whether each family's table is in the kernel, where known: asked at start (a
        netlink round trip, which a first sync would follow with a wait for the GIL), and
        again after a failure."""
        self._quarantine: dict[int, Held[str]] = {family: Held() for family in self.families}
        """Per family, the quarantined pods (their first chain), each with its rules as
        compiled when nft refused them."""
        self._retry_at: dict[int, float] = {}
        """Per family failing now, when its backoff lets it be written again (monotonic)."""
        self.failures: dict[int, int] = dict.fromkeys(self.families, 0)
        """Per family, the syncs that failed in a row."""
        self._failing_since: dict[int, float] = {}
        """Per family failing now, when the first failure in a row was (wall clock)."""
        self._last_synced: dict[int, float] = {}
        self._synced = threading.Condition()
        self._synced_takes = 0
        """The state's snapshots the last finished sync had taken."""
        self.first_synced = threading.Event()
        self.on_first_sync: Callable[[], None] = lambda: None
        """Called once, when the first sync has finished (the daemon runs what waited for
        it)."""
        self._loaders = {
            family: ThreadPoolExecutor(1, thread_name_prefix=f"policy-nft{family}")
            for family in self.families
        }
        """One thread per family, the only one to use that family's nft context (a context
        is not for two threads at once): its rehearsal, then its loads."""

    def sync(self) -> None:
        if not self.state.ready():
            log.debug("waiting for the first lists of the objects policies depend on")
            return
        start, cpu_at_start = time.monotonic(), time.thread_time()
        cluster, changed_pods = self.state.take()
        if self.recorder is not None:
            # kept only to name the pods of flow records: a snapshot held past its sync
            # holds every pod it listed
            self._cluster = cluster
        try:
            self._sync(cluster, changed_pods, start, cpu_at_start)
        finally:
            with self._synced:
                self._synced_takes = self.state.takes
                self._synced.notify_all()
            if not self.first_synced.is_set():
                self.first_synced.set()
                self.on_first_sync()

    def admit(self, namespace: str, name: str, uid: str, addresses: tuple[str, ...]) -> bool:
        """The runtime gave a pod of this node these addresses (a CNI ADD this daemon serves,
        before it answers): returns once a sync that knows them has finished, so the pod's
        isolation is in the kernel before its first packet; False when the API does not know
        the pod within ADMISSION_WAIT (its watch may lag behind the runtime's), or no sync
        finished within it."""
        deadline = time.monotonic() + ADMISSION_WAIT
        while (taken := self.state.runtime_addresses(namespace, name, uid, addresses)) is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(ADMISSION_POLL)
        with self._synced:
            return self._synced.wait_for(
                lambda: self._synced_takes > taken, max(0.0, deadline - time.monotonic())
            )

    def release(self, namespace: str, name: str) -> None:
        """The runtime took back what it gave the pod's sandbox (a CNI DEL)."""
        self.state.runtime_addresses(namespace, name, "", ())

    def _sync(
        self,
        cluster: Cluster,
        changed_pods: set[PodKey] | None,
        start: float,
        cpu_at_start: float,
    ) -> None:
        loads: list[
            tuple[int, FamilyPolicy, FamilyPolicy | None, bool, bool, Future[tuple[float, float]]]
        ] = []
        # a full compile allocates an object per pod and set element: see gc_pause
        with gc_pause.paused():
            for family in self.families:
                if time.monotonic() < self._retry_at.get(family, 0.0):
                    # a failing family waits out its backoff, whatever events come meanwhile
                    continue
                made = self._make(family, cluster, changed_pods)
                if made is not None:
                    wanted, view, transaction, full = made
                    load = self._loaders[family].submit(self._load, family, transaction)
                    loads.append((family, wanted, view, full, bool(transaction), load))
        loading_total = loader_cpu = 0.0
        for family, wanted, view, full, changed, load in loads:
            try:
                loading, cpu = load.result()
            except Exception:
                if not full:  # the full table next, contained if need be
                    self._failed(family)
                    continue
                log.exception("IPv%d: nft refused the whole policy table", family)
                try:
                    wanted = self._loaders[family].submit(self._contain, family, wanted).result()
                except Exception:
                    self._failed(family)
                    continue
                loading = cpu = 0.0
            if changed and self.cutter is not None:
                self.cutter.written(family, wanted)
            self._written[family] = wanted
            if view is not None:
                self._views[family] = (wanted, view)
            else:
                self._views.pop(family, None)
            self._in_kernel[family] = True
            self.failures[family] = 0
            self._failing_since.pop(family, None)
            self._retry_at.pop(family, None)
            self._last_synced[family] = time.time()
            self.metrics.policy_last_sync.labels(family_label(family)).set(
                self._last_synced[family]
            )
            loading_total += loading
            loader_cpu += cpu
        elapsed = time.monotonic() - start
        cpu = time.thread_time() - cpu_at_start + loader_cpu
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
            loading_total * 1000,
            cpu * 1000,
        )

    def _make(
        self, family: int, cluster: Cluster, changed_pods: set[PodKey] | None
    ) -> tuple[FamilyPolicy, FamilyPolicy | None, str, bool] | None:
        """What one family's table must hold, the staged view compiled with it (None: none
        is), the transaction that makes the table so and whether that writes it whole; None
        when making them failed."""
        written = self._written[family]
        # after a failure, nothing the compiler kept is trusted
        changed = changed_pods if written is not None else None
        try:
            compiled = self._compilers[family].compile(cluster, changed)
            view = self._staged_view(family, cluster, changed)
            if view is not None:
                compiled = observed(compiled, view)
            wanted, lifted = self._held(family, compiled)
            renderer = self._renderers[family]
            # a lifted quarantine writes the whole table: nft keeps a chain's comment when its
            # rules are rewritten, and the pod's chain would go on saying it is quarantined
            if written is None or lifted:
                in_kernel = self._in_kernel[family]
                if in_kernel is None:
                    in_kernel = self._nft[family].exists()
                return wanted, view, renderer.full(wanted, replacing=in_kernel), True
            return wanted, view, renderer.partial(written, wanted), False
        except Exception:
            self._failed(family)
            return None

    def _staged_view(
        self, family: int, cluster: Cluster, changed: set[PodKey] | None
    ) -> FamilyPolicy | None:
        """The staged view of the family, when flow records are on and a policy is staged."""
        if not (self._records and cluster.staged):
            self._view_compilers.pop(family, None)
            return None
        compiler = self._view_compilers.get(family)
        if compiler is None:
            compiler = self._view_compilers[family] = FamilyCompiler(
                family, provenance=True, staged_view=True
            )
            changed = None  # a new compiler knows no pods to update
        return compiler.compile(cluster, changed)

    def _held(self, family: int, compiled: FamilyPolicy) -> tuple[FamilyPolicy, bool]:
        """The compiled table with the family's quarantined pods still quarantined, and
        whether a quarantine was lifted: a pod whose rules changed, or that left, leaves it."""
        held = self._quarantine[family]
        if not held:
            return compiled, False
        lifted = [pod for pod in held if not held.keeps(pod, signature(compiled, pod))]
        self._count_quarantined(family)
        return quarantined(compiled, set(held)), bool(lifted)

    def _contain(self, family: int, wanted: FamilyPolicy) -> FamilyPolicy:
        """Run on the family's loader thread once nft refused the whole table: finds the
        pods whose rules it refuses by nft's dry runs, quarantines them, and writes the
        table without their rules; returns what it wrote."""
        nft, renderer = self._nft[family], self._renderers[family]
        in_kernel = nft.exists()

        def accepts(pods: Sequence[str]) -> bool:
            try:
                nft.rehearse(renderer.full(subset(wanted, pods), replacing=in_kernel))
            except NftError:
                return False
            return True

        pods = sorted({chain.counter for chain in wanted.chains.values()})
        bad = refused(pods, accepts)
        contained = quarantined(wanted, bad)
        nft.run(renderer.full(contained, replacing=in_kernel))
        held = self._quarantine[family]
        for pod in bad:
            # a pod quarantined already (in a part refused whole) keeps the rules it was
            # refused with: its chain in `wanted` is the one dropping all
            if held.hold(pod, signature(wanted, pod)):
                namespace, name = wanted.owners.get(pod, ("?", "?"))
                direction = _direction(pod)
                log.error(
                    "IPv%d: nft refused the %s rules of pod %s/%s; the pod is quarantined "
                    "(all its %s dropped) until its rules change",
                    family,
                    direction,
                    namespace,
                    name,
                    direction,
                )
        self._count_quarantined(family)
        return contained

    def _count_quarantined(self, family: int) -> None:
        label = family_label(family)
        self.metrics.policy_quarantined.labels(label).set(len(self._quarantine[family]))

    def _load(self, family: int, transaction: str) -> tuple[float, float]:
        """Run on a loader thread: one family's transaction; its wall and CPU seconds."""
        began, cpu_at_start = time.monotonic(), time.thread_time()
        self._nft[family].run(transaction)
        return time.monotonic() - began, time.thread_time() - cpu_at_start

    def _rehearse(self, family: int) -> None:
        try:
            self._nft[family].rehearse(self._renderers[family].rehearsal())
        except Exception:  # the first sync pays for nft's start, and says what it refuses
            log.warning("IPv%d: nft's rehearsal of a policy table failed", family, exc_info=True)

    def _failed(self, family: int) -> None:
        """Called in an except block: nothing of the family's table is trusted any more. The
        whole table is tried again, sooner after a first failure than after many in a row:
        a table that nft keeps refusing is not rewritten every second, forever."""
        self.failures[family] += 1
        self._failing_since.setdefault(family, time.time())
        delay = backoff(self.failures[family], 1.0)
        log.exception(
            "IPv%d policy sync failed (%d in a row); the whole table is written in %.0f s",
            family,
            self.failures[family],
            delay,
        )
        self.metrics.policy_sync_failures.labels(family_label(family)).inc()
        self._written[family] = None
        self._in_kernel[family] = None
        self._retry_at[family] = time.monotonic() + delay
        self.runner.retry_after(delay)

    def health(self, timeout: float, now: float) -> dict[int, PolicyHealth]:
        """Each family's policy health: unhealthy once its syncs have failed for `timeout`
        seconds in a row (a quarantine is contained, and healthy)."""
        return {
            family: PolicyHealth(
                now - self._failing_since.get(family, now) < timeout,
                self._last_synced.get(family),
                len(self._quarantine[family]),
            )
            for family in self.families
        }

    def denied(self) -> Counter[DeniedKey]:
        """Packets the pod chains dropped, by what denied them, read from the kernel's
        counters."""
        totals: Counter[DeniedKey] = Counter()
        for family in self.families:
            written = self._written[family]
            if written is None:
                continue
            for chain, packets in counter_packets(family, TABLE).items():
                owner, isolating = written.owners.get(chain), written.isolating.get(chain)
                # a chain without isolating policies only logs for the staged view
                if owner is not None and isolating is not None:
                    direction = _direction(chain)
                    totals[direction, owner[0], ",".join(sorted(isolating))] += packets
        return totals

    def table(
        self, family: int
    ) -> tuple[FamilyPolicy | None, FamilyPolicy | None, Mapping[PodKey, Pod]]:
        """The family's table as last written, the staged view compiled with it (None: no
        policy is staged), and the pods of the cluster they were compiled from (flow records
        are resolved by them)."""
        written = self._written.get(family)
        # read apart from the table: a view is only good for the table it was compiled with
        with_view = self._views.get(family)
        view = with_view[1] if with_view is not None and with_view[0] is written else None
        return written, view, self._cluster.pods if self._cluster else {}

    def lost_records(self) -> dict[str, int]:
        """Flow records lost over the limit (the tables' LOST counters) and in the NFLOG
        socket's buffer."""
        over = 0
        for family in self.families:
            if self._written[family] is not None:
                over += counter_packets(family, TABLE).get(LOST, 0)
        buffer = self.recorder.flow_log.lost if self.recorder is not None else 0
        return {"limit": over, "buffer": buffer}

    def start(self) -> threading.Thread:
        """Sync from now on, on a thread of its own. While the watches list, the nft contexts
        open, whether the tables are in the kernel is asked, and the contexts rehearse a
        table on the loader threads, so the first sync's loads do not pay for a process's
        first transaction (docs/benchmarks.md#networkpolicy-make-bench-policy)."""
        for family, nft in self._nft.items():
            nft.open()
            with contextlib.suppress(OSError):  # asked again by the first sync, which logs it
                self._in_kernel[family] = nft.exists()
            self._loaders[family].submit(self._rehearse, family)
        self.metrics.count_denied(self.denied)
        if self.cutter is not None:
            self.cutter.start()
        if self.recorder is not None:
            self.metrics.count_lost_records(self.lost_records)
            self.recorder.flow_log.start()
        return self.runner.start("policy-sync")

    def stop(self) -> None:
        self.runner.stop()
        if self.cutter is not None:
            self.cutter.stop()
        for loader in self._loaders.values():
            loader.shutdown(wait=False)

    def cleanup(self) -> int:
        """Delete the policy tables; returns how many existed."""
        return sum(self._nft[family].delete_table() for family in self.families)


def _direction(chain: str) -> str:
    """A pod chain's direction, from its name (compile.chain_name)."""
    return "ingress" if chain.startswith("ingress") else "egress"
