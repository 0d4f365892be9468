"""The proxy bench's IPVS mode (bench/proxy_modes.py): its bare loads and the bare change of
one service, as text (pure); the loads themselves run in the VM (bench/proxy_vm.py)."""

from __future__ import annotations

from bench.proxy_modes import SECTION, Ipvs
from proxyd.model import Endpoint
from tests.support.example_service import CTX, PORT, planned

SAVED_IPV4 = f"""{SECTION}ip
address add 10.96.0.10/32 dev knit-ipvs0
{SECTION}ipset
create KNIT-CLUSTER-IP hash:ip,port family inet hashsize 1024 maxelem 65536
add KNIT-CLUSTER-IP 10.96.0.10,tcp:80
{SECTION}ipvsadm
-A -t 10.96.0.10:80 -s rr
-a -t 10.96.0.10:80 -r 10.244.2.5:8080 -m -w 1
{SECTION}iptables
*nat
:PREROUTING ACCEPT [0:0]
:KNIT-IPVS-SERVICES - [0:0]
-A PREROUTING -j KNIT-IPVS-SERVICES
-A KNIT-IPVS-SERVICES -m set --match-set KNIT-CLUSTER-IP dst,dst -j ACCEPT
COMMIT
"""


def parts(load: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in load.splitlines():
        if line.startswith(SECTION):
            current = found.setdefault(line.removeprefix(SECTION), [])
        else:
            current.append(line)
    return found


def test_a_fresh_load_makes_the_dummy_link_first_and_hooks_the_chains() -> None:
    ((family, load),) = Ipvs().scripts({4: SAVED_IPV4}, fresh=True)
    written = parts(load)
    assert family == 4
    assert list(written) == ["ip", "ipset", "ipvsadm", "iptables"]
    assert written["ip"] == [
        "link add knit-ipvs0 type dummy",
        "address add 10.96.0.10/32 dev knit-ipvs0",
    ]
    assert written["ipvsadm"] == [
        "-A -t 10.96.0.10:80 -s rr",
        "-a -t 10.96.0.10:80 -r 10.244.2.5:8080 -m -w 1",
    ]
    assert "-I PREROUTING 1 -j KNIT-IPVS-SERVICES" in written["iptables"]
    assert ":KNIT-IPVS-SERVICES - [0:0]" in written["iptables"]


def test_a_load_over_the_same_state_edits_and_replaces_without_adding_hooks() -> None:
    ((_, load),) = Ipvs().scripts({4: SAVED_IPV4}, fresh=False)
    written = parts(load)
    assert written["ip"] == ["address replace 10.96.0.10/32 dev knit-ipvs0"]
    assert written["ipvsadm"] == [
        "-E -t 10.96.0.10:80 -s rr",
        "-e -t 10.96.0.10:80 -r 10.244.2.5:8080 -m -w 1",
    ]
    assert not any("PREROUTING" in line for line in written["iptables"])


def test_one_replaced_endpoint_is_one_real_server_added_and_one_deleted() -> None:
    before = planned(PORT, (Endpoint("10.244.2.5", 8080), Endpoint("10.244.2.6", 8080)), CTX)
    after = planned(PORT, (Endpoint("10.244.2.6", 8080), Endpoint("10.244.9.1", 8080)), CTX)
    assert parts(Ipvs().change(CTX, before, after)) == {
        "ipvsadm": [
            "-a -t 10.96.0.10:80 -r 10.244.9.1:8080 -m -w 1",
            "-d -t 10.96.0.10:80 -r 10.244.2.5:8080",
        ]
    }
