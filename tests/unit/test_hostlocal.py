"""host-local's allocator and store on a temporary dataDir (no kernel involved)."""

from __future__ import annotations

import ipaddress
import threading
from pathlib import Path

import pytest

from cni.errors import CniError, Code
from cni.ipam.hostlocal import HostLocal, parse_conf


def make(tmp_path: Path, ranges: list, requested: list | None = None, **ipam) -> HostLocal:
    raw = {
        "cniVersion": "1.1.0",
        "name": "net1",
        "ipam": {"type": "host-local", "ranges": ranges, "dataDir": str(tmp_path), **ipam},
        "runtimeConfig": {"ips": requested or []},
    }
    return HostLocal(parse_conf(raw, "net1", {}))


def addresses(result) -> list[str]:
    return [str(ip.address) for ip in result.ips]


def test_defaults_skip_network_gateway_and_broadcast(tmp_path):
    ipam = make(tmp_path, [[{"subnet": "10.1.0.0/29"}]])
    got = [addresses(ipam.add(f"c{i}", "eth0"))[0] for i in range(5)]
    assert got == [f"10.1.0.{n}/29" for n in range(2, 7)]
    with pytest.raises(CniError) as err:
        ipam.add("c9", "eth0")
    assert err.value.code == Code.IPAM_FAILURE
    assert "no IP addresses available in range set: 10.1.0.1-10.1.0.6" in err.value.msg


def test_store_format_matches_reference(tmp_path):
    ipam = make(tmp_path, [[{"subnet": "10.1.0.0/24"}], [{"subnet": "fd00:1::/64"}]])
    ipam.add("cid-1", "eth0")
    directory = tmp_path / "net1"
    assert (directory / "10.1.0.2").read_bytes() == b"cid-1\r\neth0"
    assert (directory / "fd00:1::2").read_bytes() == b"cid-1\r\neth0"
    assert (directory / "last_reserved_ip.0").read_text() == "10.1.0.2"
    assert (directory / "last_reserved_ip.1").read_text() == "fd00:1::2"
    assert (directory / "lock").exists()


def test_round_robin_continues_after_last_reserved(tmp_path):
    ipam = make(tmp_path, [[{"subnet": "10.1.0.0/29"}]])
    ipam.add("a", "eth0")
    ipam.add("b", "eth0")
    ipam.release("a", "eth0")
    assert addresses(ipam.add("c", "eth0")) == ["10.1.0.4/29"]


def test_round_robin_wraps_across_ranges(tmp_path):
    ranges = [
        [
            {"subnet": "10.1.0.0/24", "rangeStart": "10.1.0.10", "rangeEnd": "10.1.0.11"},
            {"subnet": "10.2.0.0/24", "rangeStart": "10.2.0.10", "rangeEnd": "10.2.0.10"},
        ]
    ]
    ipam = make(tmp_path, ranges)
    got = [addresses(ipam.add(f"c{i}", "eth0"))[0] for i in range(3)]
    assert got == ["10.1.0.10/24", "10.1.0.11/24", "10.2.0.10/24"]
    ipam.release("c0", "eth0")
    assert addresses(ipam.add("c3", "eth0")) == ["10.1.0.10/24"]


def test_reads_old_format_files_and_last_reserved_from_reference(tmp_path):
    directory = tmp_path / "net1"
    directory.mkdir()
    (directory / "10.1.0.2").write_text("old-container")
    (directory / "last_reserved_ip.0").write_text("10.1.0.2")
    ipam = make(tmp_path, [[{"subnet": "10.1.0.0/24"}]])
    assert addresses(ipam.add("new", "eth0")) == ["10.1.0.3/24"]
    ipam.release("old-container", "eth0")
    assert not (directory / "10.1.0.2").exists()


def test_dual_stack_gives_one_address_per_set_with_gateways_and_routes(tmp_path):
    ipam = make(
        tmp_path,
        [[{"subnet": "10.1.0.0/24", "gateway": "10.1.0.254"}], [{"subnet": "fd00:1::/64"}]],
        routes=[{"dst": "0.0.0.0/0"}, {"dst": "fd00:9::1/64", "gw": "fd00:1::9"}],
    )
    result = ipam.add("c", "eth0")
    assert addresses(result) == ["10.1.0.1/24", "fd00:1::2/64"]
    assert [str(ip.gateway) for ip in result.ips] == ["10.1.0.254", "fd00:1::1"]
    assert [(str(r.dst), str(r.gw) if r.gw else None) for r in result.routes] == [
        ("0.0.0.0/0", None),
        ("fd00:9::/64", "fd00:1::9"),
    ]


def test_requested_ips(tmp_path):
    ipam = make(tmp_path, [[{"subnet": "10.1.0.0/24"}]], requested=["10.1.0.50/24"])
    assert addresses(ipam.add("c", "eth0")) == ["10.1.0.50/24"]
    ipam2 = make(tmp_path, [[{"subnet": "10.1.0.0/24"}]], requested=["10.1.0.50"])
    with pytest.raises(CniError, match=r"10\.1\.0\.50 is not available"):
        ipam2.add("d", "eth0")
    ipam3 = make(tmp_path, [[{"subnet": "10.1.0.0/24"}]], requested=["10.9.0.5"])
    with pytest.raises(CniError, match=r"failed to allocate all requested IPs: 10\.9\.0\.5"):
        ipam3.add("e", "eth0")
    assert not (tmp_path / "net1" / "10.1.0.2").exists(), "a failed ADD keeps nothing"


def test_requested_ip_from_cni_args(tmp_path):
    raw = {
        "name": "net1",
        "ipam": {"type": "host-local", "subnet": "10.1.0.0/24", "dataDir": str(tmp_path)},
    }
    ipam = HostLocal(parse_conf(raw, "net1", {"IP": "10.1.0.77"}))
    assert addresses(ipam.add("c", "eth0")) == ["10.1.0.77/24"]


def test_duplicate_allocation_refused(tmp_path):
    ipam = make(tmp_path, [[{"subnet": "10.1.0.0/24"}]])
    ipam.add("c", "eth0")
    with pytest.raises(CniError, match="duplicate allocation"):
        ipam.add("c", "eth0")
    assert addresses(ipam.add("c", "eth1")) == ["10.1.0.3/24"]


@pytest.mark.parametrize(
    ("ranges", "message"),
    [
        ([[{"subnet": "10.1.0.0/33"}]], "invalid subnet"),
        ([[{"subnet": "10.1.0.1/24"}]], "invalid subnet"),
        ([[{"subnet": "10.1.0.0/31"}]], "too small"),
        ([[{"subnet": "10.1.0.0/24", "rangeStart": "10.2.0.1"}]], "not a host address of"),
        ([[{"subnet": "10.1.0.0/24", "rangeStart": "10.1.0.0"}]], "not a host address of"),
        ([[{"subnet": "10.1.0.0/24", "rangeEnd": "10.1.0.255"}]], "not a host address of"),
        ([[{"subnet": "10.1.0.0/24", "gateway": "10.1.0.0"}]], "not a host address of"),
        ([[{"subnet": "10.1.0.0/24", "rangeStart": "10.1.0.5/24"}]], "not an IP address"),
        ([[{"subnet": "10.1.0.0/24", "gateway": "10.1.0.1/24"}]], "not an IP address"),
        (
            [[{"subnet": "10.1.0.0/24", "rangeStart": "10.1.0.9", "rangeEnd": "10.1.0.3"}]],
            "is after rangeEnd",
        ),
        ([[{"subnet": "10.1.0.0/24"}, {"subnet": "10.1.0.0/25"}]], "overlap"),
        ([[{"subnet": "10.1.0.0/24"}], [{"subnet": "10.1.0.0/24"}]], "overlaps with"),
        ([[{"subnet": "10.1.0.0/24"}, {"subnet": "fd00::/64"}]], "mixes address families"),
        ([], "needs ranges"),
    ],
)
def test_invalid_ranges_are_code_7(tmp_path, ranges, message):
    with pytest.raises(CniError) as err:
        make(tmp_path, ranges)
    assert err.value.code == Code.INVALID_NETWORK_CONFIG
    assert message in err.value.msg


def test_gc_releases_everything_not_valid(tmp_path):
    ipam = make(tmp_path, [[{"subnet": "10.1.0.0/24"}]])
    for cid in ("keep", "drop1", "drop2"):
        ipam.add(cid, "eth0")
    (tmp_path / "net1" / "10.1.0.99").write_text("keep")  # an old-format file of a live pod
    ipam.gc({("keep", "eth0")})
    left = sorted(p.name for p in (tmp_path / "net1").iterdir() if p.name[0].isdigit())
    assert left == ["10.1.0.2", "10.1.0.99"]


def test_status_reports_exhaustion_and_unusable_data_dir(tmp_path):
    ipam = make(tmp_path, [[{"subnet": "10.1.0.0/30"}]])
    ipam.status()
    ipam.add("c", "eth0")
    with pytest.raises(CniError) as err:
        ipam.status()
    assert err.value.code == Code.NOT_AVAILABLE
    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(CniError) as err:
        make(blocked, [[{"subnet": "10.1.0.0/24"}]]).status()
    assert err.value.code == Code.NOT_AVAILABLE


def test_concurrent_allocations_are_distinct(tmp_path):
    results: list[str] = []

    def worker(i: int) -> None:
        ipam = make(tmp_path, [[{"subnet": "10.1.0.0/24"}]])
        results.append(addresses(ipam.add(f"c{i}", "eth0"))[0])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 32
    assert all(ipaddress.ip_interface(r) in ipaddress.ip_network("10.1.0.0/24") for r in results)


def test_an_unknown_option_is_code_2_naming_key_and_value(tmp_path):
    with pytest.raises(CniError) as err:
        make(tmp_path, [[{"subnet": "10.1.0.0/24"}]], resolvconf="/etc/resolv.conf")
    assert err.value.code == Code.UNSUPPORTED_FIELD
    assert err.value.msg == 'unknown host-local option(s) resolvconf="/etc/resolv.conf"'


def test_release_takes_old_format_files_only_when_no_current_one_matches(tmp_path):
    ipam = make(tmp_path, [[{"subnet": "10.1.0.0/24"}]])
    ipam.add("c", "eth0")
    old = tmp_path / "net1" / "10.1.0.99"
    old.write_text("c")  # the container's reservation from a plugin before ifnames
    ipam.release("c", "eth0")
    assert not (tmp_path / "net1" / "10.1.0.2").exists()
    assert old.exists(), "the reference's ReleaseByID keeps it while a current file matched"
    ipam.release("c", "eth0")
    assert not old.exists()


def test_the_store_lock_is_reentrant_in_a_thread_and_excludes_other_threads(tmp_path):
    """What the daemon's start-up GC relies on to scan and release under one hold."""
    ipam = make(tmp_path, [[{"subnet": "10.1.0.0/29"}]])
    nested = threading.Event()
    added = threading.Event()
    added_while_held: list[bool] = []

    def hold_twice_and_let_another_thread_add() -> None:
        with ipam.store.locked(), ipam.store.locked():
            nested.set()
            adder.start()
            added_while_held.append(added.wait(0.3))

    adder = threading.Thread(target=lambda: (ipam.add("c", "eth0"), added.set()), daemon=True)
    holder = threading.Thread(target=hold_twice_and_let_another_thread_add, daemon=True)
    holder.start()
    holder.join(5)
    assert nested.is_set() and not holder.is_alive(), "the thread holding it took it again"
    assert added_while_held == [False], "another thread's ADD waited for the lock"
    assert added.wait(5), "the ADD ran once the lock was let go"
