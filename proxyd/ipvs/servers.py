"""Make the kernel's virtual servers match the wanted ones, removing real servers gracefully.

A real server that leaves a TCP virtual server first gets weight 0 (no new connections,
established ones continue) and is deleted once IPVS counts neither active nor inactive
connections to it, checked on every later sync; one without connections, and every UDP and
SCTP real server, is deleted at once (kube-proxy's rule: IPVS counts no connection state for
those it could wait on). A real server that comes back is given weight 1 again.
A virtual server that is no longer wanted is deleted with its real servers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from proxyd.ipvs.desired import Frontend, RealServer, VirtualServer
from proxyd.ipvs.netlink import DestInfo, IpvsKernel, ServiceInfo

WEIGHT = 1
IMMEDIATE_REMOVAL = frozenset({"UDP", "SCTP"})


def _idle(info: DestInfo) -> bool:
    return info.active == 0 and info.inactive == 0


class ServerSync:
    """The virtual servers of one family."""

    def __init__(self, kernel: IpvsKernel, family: int) -> None:
        self.kernel = kernel
        self.family = family
        self.terminating: dict[Frontend, set[RealServer]] = {}
        """Real servers at weight 0, waiting for their connections to end."""

    def apply(
        self,
        previous: Mapping[Frontend, VirtualServer | None],
        wanted: Callable[[Frontend], VirtualServer | None],
        existing: Mapping[Frontend, ServiceInfo] | None = None,
    ) -> None:
        """Program the frontends of `previous` (on a full sync: every wanted and every owned
        one), each with the virtual server wanted before (None: none, or not known), then
        delete the terminating real servers of other frontends whose connections ended.

        `existing` is the kernel's virtual servers of the family when the caller has read
        them; else each frontend's is asked for. A virtual server's real servers are read only
        when it may hold one no longer wanted: one was removed, or what was wanted is unknown.
        """
        todo = sorted(previous)
        for frontend in todo:
            server = wanted(frontend)
            info = self.kernel.service(frontend) if existing is None else existing.get(frontend)
            if server is None:
                self.terminating.pop(frontend, None)
                if info is not None:
                    self.kernel.delete_service(frontend)
                continue
            if info is None:
                self.kernel.add_service(server)
                self._real_servers(server, {})
                continue
            if (info.scheduler, info.timeout) != (server.scheduler, server.timeout):
                self.kernel.set_service(server)
            before = previous[frontend]
            if before is None or before.real_servers - server.real_servers:
                self._real_servers(server, self.kernel.dests(frontend))
            else:
                self._add_real_servers(server, server.real_servers - before.real_servers)
        for frontend in sorted(self.terminating.keys() - set(todo)):
            self._reap(frontend)

    def _add_real_servers(self, server: VirtualServer, added: frozenset[RealServer]) -> None:
        """Real servers new to a virtual server that lost none: a draining one gets its
        weight back, the others are added."""
        frontend = server.frontend
        draining = self.terminating.pop(frontend, set())
        for real in sorted(added):
            if real in draining:
                self.kernel.set_dest(frontend, real, WEIGHT)
                draining.discard(real)
            else:
                self.kernel.add_dest(frontend, real, WEIGHT)
        if draining:
            self.terminating[frontend] = draining

    def _real_servers(self, server: VirtualServer, dests: dict[RealServer, DestInfo]) -> None:
        frontend = server.frontend
        for real in sorted(server.real_servers):
            info = dests.get(real)
            if info is None:
                self.kernel.add_dest(frontend, real, WEIGHT)
            elif info.weight != WEIGHT:
                self.kernel.set_dest(frontend, real, WEIGHT)
        waiting: set[RealServer] = set()
        for real, info in sorted(dests.items()):
            if real in server.real_servers:
                continue
            if frontend.protocol in IMMEDIATE_REMOVAL or _idle(info):
                self.kernel.delete_dest(frontend, real)
                continue
            if info.weight != 0:
                self.kernel.set_dest(frontend, real, 0)
            waiting.add(real)
        self.terminating.pop(frontend, None)
        if waiting:
            self.terminating[frontend] = waiting

    def _reap(self, frontend: Frontend) -> None:
        dests = self.kernel.dests(frontend)
        waiting = self.terminating.pop(frontend) & dests.keys()
        for real in sorted(waiting):
            if _idle(dests[real]):
                self.kernel.delete_dest(frontend, real)
                waiting.discard(real)
        if waiting:
            self.terminating[frontend] = waiting
