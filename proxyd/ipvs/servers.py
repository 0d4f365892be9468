"""Make the kernel's virtual servers match the wanted ones, removing real servers gracefully.

A real server that leaves a TCP or SCTP virtual server first gets weight 0 (no new
connections, established ones continue) and is deleted once IPVS counts neither active nor
inactive connections to it, checked on every later sync; one without connections, and every
UDP real server, is deleted at once. A real server that comes back is given weight 1 again.
A virtual server that is no longer wanted is deleted with its real servers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from proxyd.ipvs.netlink import DestInfo, IpvsKernel
from proxyd.ipvs.plan import Frontend, RealServer, VirtualServer

WEIGHT = 1


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
        frontends: Iterable[Frontend],
        wanted: Callable[[Frontend], VirtualServer | None],
        full: bool,
    ) -> None:
        """Program `frontends` (on a full sync: every wanted and every owned one), then delete
        the terminating real servers of other frontends whose connections ended."""
        todo = sorted(frontends)
        if full:
            existing = self.kernel.services(self.family)
        else:
            existing = {f: info for f in todo if (info := self.kernel.service(f)) is not None}
        for frontend in todo:
            server = wanted(frontend)
            info = existing.get(frontend)
            if server is None:
                self.terminating.pop(frontend, None)
                if info is not None:
                    self.kernel.delete_service(frontend)
                continue
            if info is None:
                self.kernel.add_service(server)
            elif (info.scheduler, info.timeout) != (server.scheduler, server.timeout):
                self.kernel.set_service(server)
            self._real_servers(server, {} if info is None else self.kernel.dests(frontend))
        for frontend in sorted(self.terminating.keys() - set(todo)):
            self._reap(frontend)

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
            if frontend.protocol == "UDP" or _idle(info):
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
