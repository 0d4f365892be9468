"""The nftables datapath's kernel side beyond the behaviour suite (test_proxy_services.py): a
full sync into a table without chains, written in chunks, leaves in the kernel what one
streamed transaction leaves over an existing table (a set the table had is gone, and a gone
port's chains and sets) or over the same ports (nothing doubled); a refused transaction stops
the ones after it, and an error making one goes on once the load under way ended; a streamed
transaction commits nothing when nft refuses it (the error quoting the line nft names), when a
piece cannot be made or when nft stops reading; the libnftables context sees what an nft
process wrote and writes where it was opened."""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from proxyd.metrics import Metrics
from proxyd.model import ServicePort, ServicePortName
from proxyd.nftables import proxier as nftables_proxier
from proxyd.nftables.kernel import Context, Nft, NftError
from proxyd.nftables.proxier import NftablesProxier
from proxyd.proxier import ProxyOptions
from proxyd.tracker import Changes, ServiceView
from tests.conftest import Netns
from tests.unit.example_service import NODE, PORT, READY

OPTIONS = ProxyOptions(cluster_cidrs=("10.244.0.0/16",))
SHARED_IP = ("203.0.113.7",)
PORTS = (
    dataclasses.replace(PORT, external_ips=SHARED_IP, affinity_timeout=30),
    ServicePort(ServicePortName("ns", "a", "", "TCP"), ("10.96.0.11",), 80, node_port=30080),
    ServicePort(
        ServicePortName("ns", "lb", "", "TCP"),
        ("10.96.0.12",),
        443,
        load_balancer_ips=("198.51.100.9",),
        source_ranges=("192.0.2.0/24",),
    ),
    ServicePort(ServicePortName("ns", "udp", "dns", "UDP"), ("10.96.0.13",), 53),
    ServicePort(
        ServicePortName("ns", "zz", "", "TCP"), ("10.96.0.14",), 80, external_ips=SHARED_IP
    ),
)


def changes(ports: Iterable[ServicePort]) -> Changes:
    services = {
        (port.name.namespace, port.name.name): ServiceView([port], {port: READY}) for port in ports
    }
    return Changes(services=services, node=NODE)


def table(ns: Netns) -> list[str]:
    """The table's objects with handles left out and elements sorted."""

    def plain(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: plain(item) for key, item in value.items() if key != "handle"}
        if isinstance(value, list):
            return [plain(item) for item in value]
        return value

    listing = json.loads(ns.run("nft", "-j", "list", "table", "ip", "knit").stdout)["nftables"]
    objects = []
    for entry in listing:
        entry = plain(entry)
        for kind in ("set", "map"):
            if "elem" in entry.get(kind, {}):
                entry[kind]["elem"] = sorted(entry[kind]["elem"], key=json.dumps)
        objects.append(json.dumps(entry, sort_keys=True))
    return sorted(objects)


def transactions_of(sync: Callable[[Changes], object], ports: Iterable[ServicePort]) -> list[str]:
    """The transactions a sync of `ports` ran, in order (listings left out)."""
    ran: list[str] = []
    run, run_streamed = Context.run, Nft.run_streamed

    def recorded(self: Context, text: str) -> str:
        if not text.startswith("list "):
            ran.append(text)
        return run(self, text)

    def recorded_streamed(self: Nft, pieces: Iterable[str]) -> None:
        made: list[str] = []

        def passed() -> Iterator[str]:
            for piece in pieces:
                made.append(piece)
                yield piece

        run_streamed(self, passed())
        ran.append("".join(made))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Context, "run", recorded)
        patch.setattr(Nft, "run_streamed", recorded_streamed)
        sync(changes(ports))
    return ran


def test_chunks_into_a_table_without_chains_leave_what_one_streamed_transaction_leaves(
    make_netns: Callable[[str], Netns], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nftables_proxier, "FIRST_CHUNK", 1)
    monkeypatch.setattr(nftables_proxier, "LARGEST_CHUNK", 2)
    chunked, absent, whole, again = (make_netns("knit-nft") for _ in range(4))
    chunked.run("nft", "add table ip knit { set stray { type ipv4_addr ; } ; }")
    first_written = []
    for ns in (chunked, absent):
        with ns.entered():
            written = transactions_of(NftablesProxier(OPTIONS, (4,), Metrics()).sync, PORTS)
        assert len(written) == 4, "the fixed part, then 5 ports: 1, 2 and 2"
        first_written.append(written[0])
    assert first_written[0].startswith("add table ip knit\ndelete table ip knit\n")
    assert "delete" not in first_written[1], "a table that does not exist is not deleted"
    gone = ServicePort(
        ServicePortName("ns", "gone", "", "TCP"),
        ("10.96.0.15",),
        80,
        load_balancer_ips=("198.51.100.10",),
        source_ranges=("192.0.2.0/24",),
        affinity_timeout=60,
    )
    with whole.entered():
        NftablesProxier(OPTIONS, (4,), Metrics()).sync(changes((gone,)))
        proxier = NftablesProxier(OPTIONS, (4,), Metrics())
        (streamed,) = transactions_of(proxier.sync, PORTS)
    with again.entered():
        NftablesProxier(OPTIONS, (4,), Metrics()).sync(changes(PORTS))
        proxier = NftablesProxier(OPTIONS, (4,), Metrics())
        assert len(transactions_of(proxier.sync, PORTS)) == 1
    assert table(again) == table(whole), "over the same ports: each chain emptied, then filled"
    for stale in ("set ip knit affinity-", "chain ip knit firewall-", "chain ip knit service-"):
        assert f"delete {stale}" in streamed and "/gone/" in streamed.split(f"delete {stale}")[1]
    assert table(chunked) == table(whole), "the same objects; the stray set, the gone port's gone"
    assert table(absent) == table(whole)
    assert any("198.51.100.9" in entry for entry in table(chunked)), "the firewall's element"


def test_a_refused_transaction_stops_the_ones_after_it(
    make_netns: Callable[[str], Netns],
) -> None:
    ns = make_netns("knit-nft")
    made: list[str] = []

    def texts() -> Iterable[str]:
        for text in ("add table ip first", "add chain ip missing c", "add table ip after"):
            made.append(text)
            yield text

    with ns.entered(), pytest.raises(NftError, match="missing"):
        Nft(4).run_each(texts())
    assert len(made) == 3, "the next is made while nft loads one"
    tables = ns.run("nft", "list", "tables").stdout.split("\n")
    assert tables == ["table ip first", ""]


def test_an_error_making_a_transaction_goes_on_once_the_load_under_way_ended(
    make_netns: Callable[[str], Netns],
) -> None:
    ns = make_netns("knit-nft")

    def texts() -> Iterable[str]:
        yield "add table ip first"
        yield "add chain ip missing c"
        raise ValueError("a service nft cannot take")

    with ns.entered(), pytest.raises(ValueError, match="cannot take"):
        Nft(4).run_each(texts())
    tables = ns.run("nft", "list", "tables").stdout.split("\n")
    assert tables == ["table ip first", ""], "loaded before the error, the refused one not"


def test_a_streamed_transaction_nft_refuses_commits_nothing(
    make_netns: Callable[[str], Netns],
) -> None:
    ns = make_netns("knit-nft")
    made: list[str] = []

    def pieces() -> Iterator[str]:
        for piece in ("add table ip first\n", "add chain ip first c\n", "add rule ip first c ip "):
            made.append(piece)
            yield piece
        yield "daddr 192.0.2.1 goto nowhere\nadd table ip after\n"

    with ns.entered(), pytest.raises(NftError, match="No such file") as refused:
        Nft(4).run_streamed(pieces())
    assert len(made) == 3
    assert "line 3: add rule ip first c ip daddr 192.0.2.1 goto nowhere" in str(refused.value), (
        "the line nft names is quoted, across pieces"
    )
    assert ns.run("nft", "list", "tables").stdout == ""


@pytest.mark.parametrize("error", [ValueError, BrokenPipeError])
def test_a_piece_that_cannot_be_made_leaves_nothing_of_its_transaction(
    make_netns: Callable[[str], Netns], error: type[Exception]
) -> None:
    ns = make_netns("knit-nft")

    def pieces() -> Iterator[str]:
        yield "add table ip first\n"
        raise error("a service nft cannot take")

    with ns.entered(), pytest.raises(error, match="cannot take"):
        Nft(4).run_streamed(pieces())
    assert ns.run("nft", "list", "tables").stdout == "", "nft got an unparsable end"


def test_a_stream_nft_stops_reading_ends_with_its_error(
    make_netns: Callable[[str], Netns],
) -> None:
    ns = make_netns("knit-nft")
    raised: list[BaseException] = []

    def pieces() -> Iterator[str]:
        yield "not nft\n" * 20
        for index in range(200):
            yield f"add table ip t{index}\n" * 1000

    def load() -> None:
        with ns.entered():
            try:
                Nft(4).run_streamed(pieces())
            except NftError as err:
                raised.append(err)

    loading = threading.Thread(target=load, daemon=True)
    loading.start()
    loading.join(timeout=60)
    assert not loading.is_alive(), "the writer stops when nft's parser gives up"
    assert len(raised) == 1 and "syntax error" in str(raised[0])
    assert ns.run("nft", "list", "tables").stdout == ""


def test_the_names_listed_are_our_tables_chains_and_named_sets(
    make_netns: Callable[[str], Netns],
) -> None:
    ns = make_netns("knit-nft")
    ns.run(
        "nft",
        "add table ip knit { set s { type ipv4_addr ; } ; map m { type ipv4_addr : verdict ; } ; "
        "chain c { ip saddr { 192.0.2.1, 192.0.2.2 } drop ; } ; } ; "
        "add table ip other { set o { type ipv4_addr ; } ; chain oc { } ; } ; "
        "add table ip6 knit { set s6 { type ipv6_addr ; } ; chain c6 { } ; } ; "
        "add table ip bare",
    )
    with ns.entered():
        assert (Nft(4).chains(), Nft(4).sets()) == ({"c"}, {"s"})
        assert (Nft(6).chains(), Nft(6).sets()) == ({"c6"}, {"s6"})
        assert (Nft(4, "bare").chains(), Nft(4, "bare").sets()) == (set(), set())
        assert (Nft(4, "missing").chains(), Nft(4, "missing").sets()) == (None, set())


def test_the_context_follows_what_others_wrote_and_writes_where_it_was_opened(
    make_netns: Callable[[str], Netns],
) -> None:
    ns, other = make_netns("knit-nft"), make_netns("knit-nft")
    kernel = Nft(4)
    with ns.entered():
        kernel.run("add table ip knit\nadd set ip knit old { type ipv4_addr ; }\n")
    ns.run("nft", "delete table ip knit; add table ip knit { set new { type ipv4_addr ; } ; }")
    with other.entered():
        kernel.run("add element ip knit new { 192.0.2.1 }\n")
        with pytest.raises(NftError, match="No such file or directory"):
            kernel.run(
                "add element ip knit new { 192.0.2.2 }\nadd element ip knit old { 1.2.3.4 }\n"
            )
    assert "elements = { 192.0.2.1 }" in ns.run("nft", "list", "set", "ip", "knit", "new").stdout, (
        "the context writes where it was opened; a refused transaction leaves nothing"
    )
    assert other.run("nft", "list", "tables").stdout == ""
