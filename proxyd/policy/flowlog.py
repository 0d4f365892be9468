"""What the pod chains hand to NFLOG, and its reading: the first packet of a connection a pod
chain gives a verdict to (pod chains only ever see first packets: the base chain accepts
established traffic before them), at most `rate` a second per node and family (a named limit
in the table), with a prefix naming the chain, the rule and the verdict. This module encodes
that prefix, subscribes to the group over netlink and reads each packet's addresses and
ports; flows.py resolves what it read to the policy rule behind it.

Over the limit, the rule after the logging one gives the same verdict unlogged and counts
the packet in the table's LOST counter; records the socket's buffer could not take show as
gaps in NFLOG's sequence numbers, counted in `FlowLog.lost`.

NFLOG rather than the kernel log: the kernel logs packets of namespaces other than the host's
only when the host allows it (net.netfilter.nf_log_all_netns), and a node daemon has no
business changing that; NFLOG delivers to a socket of the namespace the rule lives in.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from cni.kernel.rawnetlink import NETLINK_NETFILTER, NFGENMSG, NetlinkSocket, attribute, attributes
from proxyd.policy.compile import ALLOW, DROP

log = logging.getLogger(__name__)

GROUP = 7100
"""The NFLOG group the pod chains log to."""
LIMIT = "flow-log"
"""The named limit every pod chain's logging rules share, one per family's table."""
LOST = "flow-lost"
"""The named counter of the packets a logging rule matched over the limit."""
ULOG_SUBSYSTEM = 4
PACKET_MESSAGE = ULOG_SUBSYSTEM << 8
CONFIG_MESSAGE = (ULOG_SUBSYSTEM << 8) | 1
CONFIG_COMMAND, CONFIG_MODE, CONFIG_TIMEOUT, CONFIG_FLAGS = 1, 2, 4, 6
BIND = 1
COPY_PACKET = 2
COPY_BYTES = 64
"""Enough of each packet for its IP header and ports."""
FLUSH_TIMEOUT = 10
"""Hundredths of a second the kernel may batch packets before it sends them (its default, a
second, would make `kubectl knit flows -f` lag)."""
WANT_SEQUENCE = 1
"""NFULNL_CFG_F_SEQ: each packet numbered, so that a gap shows what the buffer lost."""
BUFFER_BYTES = 4 << 20
"""The reader's socket buffer. The default (net.core.rmem_default, 208 KiB) holds about 1,150
records unread, and the limit lets a burst of as many records as its rate through after a
quiet second: at 1,000 a second, a daemon a little late lost 200-odd of one. This one holds
more than 30,000 (docs/observability.md)."""
PAYLOAD, PREFIX, SEQUENCE = 9, 10, 12
PORTED = {6: "tcp", 17: "udp", 132: "sctp"}
ADDRESSES_KEPT = 4096
"""Addresses whose text the reader remembers (and that PodIndex remembers the pod of)."""
END = "end"
"""The prefix's rule index for a chain's own verdict, after its rules."""


@dataclass(frozen=True)
class Logging:
    """What the pod chains log: the first packet of each verdict in `verdicts` (ALLOW,
    DROP), at most `rate` a second per family."""

    rate: int
    verdicts: frozenset[str]


def logging_for(flow_rate: int, denied_rate: int) -> Logging | None:
    """Flow records log every verdict, under their rate; without them, the log of denied
    connections logs drops under its own; neither: nothing is logged."""
    if flow_rate:
        return Logging(flow_rate, frozenset({ALLOW, DROP}))
    if denied_rate:
        return Logging(denied_rate, frozenset({DROP}))
    return None


def prefix(chain: str, index: int | None, verdict: str) -> str:
    """`CHAIN RULE VERDICT`: RULE the index among the chain's compiled matches, or END."""
    return f"{chain} {END if index is None else index} {verdict}"


@dataclass(frozen=True)
class Logged:
    """One packet a pod chain logged: where its verdict came from and what it was."""

    chain: str
    index: int | None
    verdict: str
    protocol: str
    source: str
    source_port: int | None
    destination: str
    port: int | None
    at: float
    """When the daemon read it (wall clock)."""


def parse(text: str, packet: bytes, at: float) -> Logged | None:
    """The packet NFLOG reported under the prefix `text`; None when either cannot be read."""
    fields = text.split(" ")
    if len(fields) != 3 or not (fields[1] == END or fields[1].isdigit()) or not packet:
        return None
    chain, index, verdict = fields[0], None if fields[1] == END else int(fields[1]), fields[2]
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
    source_port = port = None
    if number in PORTED and len(packet) >= transport + 4:
        source_port, port = struct.unpack_from("!HH", packet, transport)
    return Logged(
        chain,
        index,
        verdict,
        protocol,
        address_text(source),
        source_port,
        address_text(destination),
        port,
        at,
    )


@functools.lru_cache(maxsize=ADDRESSES_KEPT)
def address_text(packed: bytes) -> str:
    """An address as a record shows it, from its bytes in the packet: remembered, since a
    node's records name the same few addresses over and over (ipaddress takes microseconds)."""
    return str(ipaddress.ip_address(packed))


class Sequence:
    """Counts the packets missing between NFLOG's sequence numbers (u32, wrapping)."""

    def __init__(self) -> None:
        self.lost = 0
        self._next: int | None = None

    def saw(self, number: int) -> None:
        if self._next is not None:
            gap = (number - self._next) % (1 << 32)
            if gap < 1 << 31:  # an older number (reordered) is no loss
                self.lost += gap
        self._next = (number + 1) % (1 << 32)


class FlowLog:
    """Subscribes to GROUP and hands each packet read to `report`."""

    def __init__(self, report: Callable[[Logged], None]) -> None:
        self._report = report
        self.sequence = Sequence()

    @property
    def lost(self) -> int:
        """Packets logged that the socket's buffer could not take."""
        return self.sequence.lost

    def _subscribe(self, sock: NetlinkSocket) -> None:
        header = NFGENMSG.pack(socket.AF_UNSPEC, 0, GROUP)
        sock.request(CONFIG_MESSAGE, header + attribute(CONFIG_COMMAND, bytes((BIND, 0, 0, 0))))
        mode = struct.pack("!IBB", COPY_BYTES, COPY_PACKET, 0) + bytes(2)
        sock.request(
            CONFIG_MESSAGE,
            header
            + attribute(CONFIG_MODE, mode)
            + attribute(CONFIG_TIMEOUT, struct.pack("!I", FLUSH_TIMEOUT))
            + attribute(CONFIG_FLAGS, struct.pack("!H", WANT_SEQUENCE)),
        )

    def run(self) -> None:
        with NetlinkSocket(NETLINK_NETFILTER) as sock:
            sock.receive_buffer(BUFFER_BYTES)
            self._subscribe(sock)
            while True:
                try:
                    self._read(sock)
                except OSError as err:
                    # the buffer overran: what it lost shows in the sequence's next gap
                    if err.errno != errno.ENOBUFS:
                        raise

    def _read(self, sock: NetlinkSocket) -> None:
        for kind, payload in sock.messages():
            if kind != PACKET_MESSAGE:
                continue
            found = attributes(payload[NFGENMSG.size :])
            number = found.get(SEQUENCE)
            if number is not None and len(number) == 4:
                self.sequence.saw(struct.unpack("!I", number)[0])
            text = bytes(found.get(PREFIX, b"")).rstrip(b"\0").decode(errors="replace")
            logged = parse(text, bytes(found.get(PAYLOAD, b"")), time.time())
            if logged is None:
                continue
            try:
                self._report(logged)
            except Exception:  # one record's failure must not end the others' (bounded by the rate)
                log.exception("cannot record a packet the policy logged: %s", logged)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._run_logged, name="policy-flows", daemon=True)
        thread.start()
        return thread

    def _run_logged(self) -> None:
        try:
            self.run()
        except OSError as err:
            log.warning("cannot read the policy's NFLOG group %d: %s", GROUP, err)
