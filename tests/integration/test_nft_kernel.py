"""The nftables datapath's kernel side beyond the behaviour suite (test_proxy_services.py): a full
sync, a transaction per chunk into the generation the rules do not name and one switching the
rules over, leaves the same objects whatever the table held (nothing, a table without chains
holding a stray set, a gone port's chains and sets and a spread chain that loses its last user,
the same ports in the other generation); a refused chunk leaves the live rules and maps as they
were, and the full sync after it mends the table; a refused transaction stops the ones after it,
and an error making one goes on once the load under way ended; the libnftables context sees what
an nft process wrote and writes where it was opened."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest

from cni.kernel.nftables import Context, NftError
from deploy.lab.netns import Netns
from proxyd.metrics import Metrics
from proxyd.model import ServicePort, ServicePortName
from proxyd.nftables import proxier as nftables_proxier
from proxyd.nftables.kernel import Nft, counter_packets
from proxyd.nftables.proxier import NftablesProxier
from proxyd.nftables.render import render_base
from proxyd.policy.render import TABLE as POLICY_TABLE
from proxyd.policy.render import Renderer
from proxyd.proxier import ProgramError, ProxyOptions
from proxyd.tracker import Changes, ServiceView
from tests.support.example_service import NODE, PORT, READY

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
    run = Context.run

    def recorded(self: Context, text: str) -> str:
        if not text.startswith("list "):
            ran.append(text)
        return run(self, text)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Context, "run", recorded)
        sync(changes(ports))
    return ran


def test_a_full_sync_leaves_the_same_objects_whatever_the_table_held(
    make_netns: Callable[[str], Netns], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nftables_proxier, "FIRST_CHUNK", 1)
    monkeypatch.setattr(nftables_proxier, "LARGEST_CHUNK", 2)
    chainless, absent, whole, again = (make_netns("knit-nft") for _ in range(4))
    chainless.run("nft", "add table ip knit { set stray { type ipv4_addr ; } ; }")
    for ns in (chainless, absent):
        with ns.entered():
            written = transactions_of(NftablesProxier(OPTIONS, (4,), Metrics()).sync, PORTS)
        assert len(written) == 5, "the maps, 5 ports in chunks of 1, 2 and 2, the rules"
        assert "add map ip knit service-ips {" in written[0]
    gone = ServicePort(
        ServicePortName("ns", "gone", "", "TCP"),
        ("10.96.0.15",),
        80,
        load_balancer_ips=("198.51.100.10",),
        source_ranges=("192.0.2.0/24",),
        affinity_timeout=60,
    )
    lonely = ServicePort(ServicePortName("ns", "lonely", "", "TCP"), ("10.96.0.16",), 80)
    before = changes((gone,))
    before.services[("ns", "lonely")] = ServiceView([lonely], {lonely: READY[:1]})
    with whole.entered():
        NftablesProxier(OPTIONS, (4,), Metrics()).sync(before)
        *_, switch = transactions_of(NftablesProxier(OPTIONS, (4,), Metrics()).sync, PORTS)
    assert "vmap @service-ips-1" in switch and "delete map ip knit service-ips\n" in switch
    assert "delete chain ip knit spread-ips-tcp-1\n" in switch, "its last user gone"
    for stale in ("set ip knit affinity-", "chain ip knit firewall-", "chain ip knit service-"):
        assert f"delete {stale}" in switch and "/gone/" in switch.split(f"delete {stale}")[1]
    with again.entered():
        for _ in range(3):
            NftablesProxier(OPTIONS, (4,), Metrics()).sync(changes(PORTS))
    with whole.entered():
        NftablesProxier(OPTIONS, (4,), Metrics()).sync(changes(PORTS))
    assert table(chainless) == table(whole), "the stray set, the gone port's objects: gone"
    assert table(absent) == table(whole) == table(again), "from either generation, doubling nothing"
    assert any("198.51.100.9" in entry for entry in table(chainless)), "the firewall's element"


def test_a_refused_chunk_leaves_the_live_rules_and_the_next_full_sync_mends(
    make_netns: Callable[[str], Netns], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nftables_proxier, "FIRST_CHUNK", 1)
    monkeypatch.setattr(nftables_proxier, "LARGEST_CHUNK", 2)
    ns, clean = make_netns("knit-nft"), make_netns("knit-nft")
    with clean.entered():
        NftablesProxier(OPTIONS, (4,), Metrics()).sync(changes(PORTS))
    full_transactions = nftables_proxier.full_transactions

    def refusing_the_third(*args: Any) -> Iterator[str]:
        for index, text in enumerate(full_transactions(*args)):
            yield text + ("add rule ip knit nowhere drop\n" if index == 2 else "")

    with ns.entered():
        NftablesProxier(OPTIONS, (4,), Metrics()).sync(changes(PORTS))
        before = table(ns)
        proxier = NftablesProxier(OPTIONS, (4,), Metrics())
        monkeypatch.setattr(nftables_proxier, "full_transactions", refusing_the_third)
        with pytest.raises(ProgramError, match="No such file"):
            proxier.sync(changes(PORTS))
        generation_one = {f"{name}-1" for name in render_base(proxier.context(4, NODE)).maps}
        after = [json.loads(entry) for entry in table(ns)]
        filled = [
            e for e in after if {e.get(k, {}).get("name") for k in ("set", "map")} & generation_one
        ]
        assert filled, "half a generation"
        live = [json.dumps(entry, sort_keys=True) for entry in after if entry not in filled]
        assert live == before, "the rules and maps packets use are as they were"
        monkeypatch.setattr(nftables_proxier, "full_transactions", full_transactions)
        proxier.sync(Changes(services={}, node=NODE))
    with clean.entered():
        NftablesProxier(OPTIONS, (4,), Metrics()).sync(changes(PORTS))
    assert table(ns) == table(clean), "the next full sync wrote generation 1 whole"


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


def test_the_names_listed_are_our_tables_chains_and_named_sets_and_maps(
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
        assert (Nft(4).chains(), Nft(4).sets()) == ({"c"}, {"s", "m"})
        assert (Nft(6).chains(), Nft(6).sets()) == ({"c6"}, {"s6"})
        assert (Nft(4, "bare").chains(), Nft(4, "bare").sets()) == (set(), set())
        assert (Nft(4, "missing").chains(), Nft(4, "missing").sets()) == (None, set())


def test_named_counters_are_read_of_one_table_of_one_family(
    make_netns: Callable[[str], Netns],
) -> None:
    ns = make_netns("knit-nft")
    ns.run(
        "nft",
        "add table ip knit { counter a { packets 5 bytes 300 ; } ; counter b { } ; "
        "quota q { 100 bytes ; } ; } ; "
        "add table ip other { counter a { packets 9 bytes 300 ; } ; } ; "
        "add table ip6 knit { counter c { packets 7 bytes 300 ; } ; }",
    )
    with ns.entered():
        assert counter_packets(4, "knit") == {"a": 5, "b": 0}
        assert counter_packets(6, "knit") == {"c": 7}
        assert counter_packets(4, "missing") == {}


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


def test_a_table_is_deleted_only_when_it_exists(make_netns: Callable[[str], Netns]) -> None:
    ns = make_netns("knit-nft")
    ns.run("nft", "add table ip knit; add table ip6 other; add table ip knit-policy")
    ran: list[str] = []
    run = Context.run

    def recorded(self: Context, text: str) -> str:
        ran.append(text)
        return run(self, text)

    with ns.entered(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(Context, "run", recorded)
        assert (Nft(4).exists(), Nft(6).exists(), Nft(6, "other").exists()) == (True, False, True)
        assert Nft(6).delete_table() is False
        assert not [text for text in ran if text.startswith("delete")], (
            "an absent table is not deleted: the kernel would abort that transaction"
        )
        assert Nft(4).delete_table() is True
    assert sorted(ns.run("nft", "list", "tables").stdout.split()[2::3]) == ["knit-policy", "other"]


def test_a_rehearsal_checks_a_whole_policy_table_and_sends_nothing(
    make_netns: Callable[[str], Netns],
) -> None:
    ns = make_netns("knit-nft")
    with ns.entered():
        for family in (4, 6):
            nft, text = Nft(family, POLICY_TABLE), Renderer(family).rehearsal()
            nft.rehearse(text)
            assert not nft.exists(), "a rehearsal sends nothing"
            with pytest.raises(NftError, match="No such file or directory"):
                nft.rehearse(text.replace("@peers-rehearsal", "@absent"))
            nft.run(text)
    listing = ns.run("nft", "list", "ruleset").stdout
    for thing in ("192.0.2.1 : jump ingress-rehearsal", "2001:db8::1 : jump ingress-rehearsal"):
        assert thing in listing, "the rehearsed table is one the kernel takes"
