"""Denied connections logged: the pod chains hand the first packets they drop, at most
`rate` a second per node and family (a named limit in the table), to an NFLOG group; this
module subscribes to that group over netlink and logs each packet with its source,
destination, port and the pod it was denied for.

NFLOG rather than the kernel log: the kernel logs packets of namespaces other than the host's
only when the host allows it (net.netfilter.nf_log_all_netns), and a node daemon has no
business changing that; NFLOG delivers to a socket of the namespace the rule lives in.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass

from cni.kernel.rawnetlink import NETLINK_NETFILTER, NFGENMSG, NetlinkSocket, attribute, attributes

log = logging.getLogger(__name__)

GROUP = 7100
"""The NFLOG group the pod chains log to."""
LIMIT = "denied-log"
"""The named limit object every pod chain's log rule shares."""
ULOG_SUBSYSTEM = 4
PACKET_MESSAGE = ULOG_SUBSYSTEM << 8
CONFIG_MESSAGE = (ULOG_SUBSYSTEM << 8) | 1
CONFIG_COMMAND, CONFIG_MODE = 1, 2
BIND = 1
COPY_PACKET = 2
COPY_BYTES = 64
"""Enough of each packet for its IP header and ports."""
PAYLOAD, PREFIX = 9, 10
PORTED = {6: "tcp", 17: "udp", 132: "sctp"}


@dataclass(frozen=True)
class Denied:
    chain: str
    protocol: str
    source: str
    destination: str
    port: int | None


def parse_packet(prefix: str, packet: bytes) -> Denied | None:
    """The denial an NFLOG packet reports (its prefix is the pod chain); None when the packet
    cannot be read."""
    if not packet:
        return None
    version = packet[0] >> 4
    if version == 4 and len(packet) >= 20:
        number, transport = packet[9], (packet[0] & 0x0F) * 4
        source, destination = packet[12:16], packet[16:20]
    elif version == 6 and len(packet) >= 40:
        number, transport = packet[6], 40
        source, destination = packet[8:24], packet[24:40]
    else:
        return None
    protocol = PORTED.get(number, str(number))
    port = None
    if number in PORTED and len(packet) >= transport + 4:
        (port,) = struct.unpack_from("!H", packet, transport + 2)
    return Denied(
        prefix,
        protocol,
        str(ipaddress.ip_address(bytes(source))),
        str(ipaddress.ip_address(bytes(destination))),
        port,
    )


class DenialLog:
    """Subscribes to GROUP; each packet is described by `describe(chain)` (the pod and the
    policies judging it) and logged."""

    def __init__(self, describe: Callable[[str], str | None]) -> None:
        self._describe = describe

    def _subscribe(self, sock: NetlinkSocket) -> None:
        header = NFGENMSG.pack(socket.AF_UNSPEC, 0, GROUP)
        sock.request(CONFIG_MESSAGE, header + attribute(CONFIG_COMMAND, bytes((BIND, 0, 0, 0))))
        mode = struct.pack("!IBB", COPY_BYTES, COPY_PACKET, 0) + bytes(2)
        sock.request(CONFIG_MESSAGE, header + attribute(CONFIG_MODE, mode))

    def report(self, denied: Denied) -> None:
        about = self._describe(denied.chain)
        if about is None:
            return
        direction = "ingress to" if denied.chain.startswith("ingress") else "egress from"
        port = f":{denied.port}" if denied.port is not None else ""
        log.info(
            "policy denied %s %s: %s %s -> %s%s",
            direction, about, denied.protocol, denied.source, denied.destination, port,
        )  # fmt: skip

    def run(self) -> None:
        with NetlinkSocket(NETLINK_NETFILTER) as sock:
            self._subscribe(sock)
            for kind, payload in sock.messages():
                if kind != PACKET_MESSAGE:
                    continue
                found = attributes(payload[NFGENMSG.size :])
                prefix = bytes(found.get(PREFIX, b"")).rstrip(b"\0").decode(errors="replace")
                denied = parse_packet(prefix, bytes(found.get(PAYLOAD, b"")))
                if denied is not None:
                    self.report(denied)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run_logged, name="policy-denials", daemon=True)
        thread.start()
        return thread

    def _run_logged(self) -> None:
        try:
            self.run()
        except OSError as err:
            log.warning("cannot log denied connections (NFLOG group %d): %s", GROUP, err)
