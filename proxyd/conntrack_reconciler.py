"""The conntrack reconciler: deletes, after the syncs that changed them, the conntrack entries
of service frontends whose reply comes from anything but a serving endpoint (every UDP one,
and the TCP and SCTP ones that saw no reply: conntrack.py says why each matters), whatever
the policies, topology or termination say, as kube-proxy does: a flow to a serving endpoint is
left to finish.

It runs on a thread of its own, after the sync rather than in it (kube-proxy reconciles at the
end of its sync): each dump the kernel filters on a port still walks the whole conntrack hash
(9.5 ms for an empty table of 262,144 buckets, measured), more than a one-service sync's rules
take, and what it deletes matters only to a flow's next packet after the rules changed, not
to the rules. The frontends of the syncs that come during a clean-up are merged, per family
and protocol, and cleaned by the next (a frontend's latest endpoints replacing its earlier
ones).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable

from cni.kernel.addresses import link_addresses
from proxyd import conntrack
from proxyd.conntrack import Frontends
from proxyd.metrics import Metrics
from proxyd.runner import IDLE, BoundedFrequencyRunner

log = logging.getLogger(__name__)

PROTOCOL_NUMBERS = {"TCP": socket.IPPROTO_TCP, "SCTP": socket.IPPROTO_SCTP}
"""The protocols whose never-answered entries are deleted."""


def _local_addresses(family: int) -> set[str]:
    return {a.address for a in link_addresses(family)}


class ConntrackReconciler:
    def __init__(
        self,
        metrics: Metrics,
        local_addresses: Callable[[int], set[str]] = _local_addresses,
    ) -> None:
        self.metrics = metrics
        self.local_addresses = local_addresses
        """The family's addresses on the node: a node port's frontends."""
        self.runner = BoundedFrequencyRunner(self.reconcile, 0.0, IDLE)
        self._lock = threading.Lock()
        self._pending: dict[int, dict[str, Frontends]] = {}
        """Per family and protocol name, the frontends changed since the last run."""

    def changed(self, by_family: dict[int, dict[str, Frontends]]) -> None:
        """A sync wrote the rules of these frontends (per family and protocol name): their
        entries are cleaned on the reconciler's thread."""
        if not any(by_family.values()):
            return
        with self._lock:
            for family, by_protocol in by_family.items():
                pending = self._pending.setdefault(family, {})
                for protocol, frontends in by_protocol.items():
                    merged = pending.setdefault(protocol, Frontends(family))
                    merged.by_address.update(frontends.by_address)
                    merged.by_node_port.update(frontends.by_node_port)
        self.runner.run()

    def reconcile(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for family, by_protocol in pending.items():
            try:
                self._reconcile(family, by_protocol)
            except Exception:  # the thread goes on: the next change cleans again
                log.exception("IPv%d: the conntrack clean-up failed", family)

    def _reconcile(self, family: int, by_protocol: dict[str, Frontends]) -> None:
        start = time.monotonic()
        try:
            if any(frontends.by_node_port for frontends in by_protocol.values()):
                local = self.local_addresses(family)
                for frontends in by_protocol.values():
                    frontends.local_addresses = local
            udp = by_protocol.pop("UDP", None)
            deleted = conntrack.clear_stale(udp) if udp else 0
            if by_protocol:
                deleted += conntrack.clear_unanswered(
                    {PROTOCOL_NUMBERS[name]: frontends for name, frontends in by_protocol.items()}
                )
        except OSError as err:  # the rules stay written, as in kube-proxy
            log.warning("conntrack clean-up failed (IPv%d): %s", family, err)
            return
        metrics = self.metrics.for_family(family)
        metrics.conntrack_sync_duration.observe(time.monotonic() - start)
        metrics.conntrack_deleted.inc(deleted)
        if deleted:
            log.info("deleted %d stale conntrack entries (IPv%d)", deleted, family)

    def start(self) -> threading.Thread:
        return self.runner.start("conntrack")

    def stop(self) -> None:
        self.runner.stop()
