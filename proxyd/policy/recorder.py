"""What the daemon does with each packet the pod chains logged (flowlog.py): with flow records
on, resolves it to a record (flows.py), keeps it in the ring the flows endpoint serves and
counts it per policy and verdict (and, where staged policies would decide otherwise, per
staged decision and would-be verdict); with the log of denied connections on, logs a denied one,
at most `denied_rate` a second per family (the kernel's limit bounds it already when only the
log is on; with records on, the kernel's limit is the records' rate).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from prometheus_client import Counter

from proxyd.metrics import Metrics
from proxyd.policy.compile import FamilyPolicy, PodKey
from proxyd.policy.flowlog import FlowLog, Logged
from proxyd.policy.flows import PodIndex, Ring, ViewJudge, direction_of, resolve
from proxyd.policy.model import INGRESS, Pod

log = logging.getLogger(__name__)

Tables = Callable[[int], tuple[FamilyPolicy | None, FamilyPolicy | None, Mapping[PodKey, Pod]]]
"""A family's table as last written, the staged view compiled with it (None: no policy is
staged), and the pods of the cluster they were compiled from."""


class Recorder:
    def __init__(
        self, node: str, tables: Tables, metrics: Metrics, records: bool, denied_rate: int
    ) -> None:
        """`records`: keep and count flow records; `denied_rate`: denied connections logged
        a second per family (0: none)."""
        self.node = node
        self._tables = tables
        self._metrics = metrics
        self.ring = Ring() if records else None
        self._denied_rate = denied_rate
        self._indexes = {4: PodIndex(), 6: PodIndex()}
        self._view_judges = {4: ViewJudge(), 6: ViewJudge()}
        self._connections: dict[tuple[str, ...], Counter] = {}
        """The connections counter of each label set counted so far (prometheus_client's
        `labels` validates and locks at each call: a record's costliest step after the
        address lookups)."""
        self._logged: dict[int, tuple[int, int]] = {}
        """Per family, the second of the last denial logged and how many that second."""
        self.flow_log = FlowLog(self.report)

    def report(self, logged: Logged) -> None:
        """Called by the NFLOG reader's thread for each packet."""
        family = 6 if ":" in logged.source else 4
        policy, view, pods = self._tables(family)
        if self.ring is not None:
            judged = None if view is None else (view, self._view_judges[family])
            record = resolve(logged, self.node, policy, pods, self._indexes[family], judged)
            self.ring.add(record.to_json())
            by = record.decided_by
            labels = (by.kind, by.namespace or "", by.name or "", record.verdict)
            counter = self._connections.get(labels)
            if counter is None:
                counter = self._connections[labels] = self._metrics.policy_connections.labels(
                    *labels
                )
            counter.inc()
            if record.staged is not None:
                by = record.staged.decided_by
                labels = (by.kind, by.namespace or "", by.name or "", record.staged.verdict)
                self._metrics.policy_staged_connections.labels(*labels).inc()
        if logged.verdict != "allow" and self._denied_rate and self._take(family, logged.at):
            self._log_denied(logged, policy)

    def _take(self, family: int, at: float) -> bool:
        second, count = self._logged.get(family, (-1, 0))
        if int(at) != second:
            second, count = int(at), 0
        if count >= self._denied_rate:
            return False
        self._logged[family] = (second, count + 1)
        return True

    def _log_denied(self, logged: Logged, policy: FamilyPolicy | None) -> None:
        pod_chain = None if policy is None else policy.chains.get(logged.chain)
        if policy is None or pod_chain is None:
            return  # the pod has left since
        namespace, name = policy.owners[pod_chain.counter]
        judging = ", ".join(sorted(policy.isolating.get(pod_chain.counter, ())))
        where = "ingress to" if direction_of(logged.chain) == INGRESS else "egress from"
        port = f":{logged.port}" if logged.port is not None else ""
        log.info(
            "policy denied %s %s/%s (judged by %s): %s %s -> %s%s",
            where, namespace, name, judging, logged.protocol, logged.source,
            logged.destination, port,
        )  # fmt: skip
