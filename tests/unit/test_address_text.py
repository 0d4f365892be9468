"""Address text knit did not write never reaches rule text with more than address characters:
an IPv6 scope ID (which Python's ipaddress keeps, whatever it holds) is refused at every
edge where addresses come in: API objects, flags, a plugin's result."""

from __future__ import annotations

from typing import Any

import pytest

from cni import ip_text
from cni.errors import CniError, Code
from cni.result import Result
from proxyd.addresses import nodeport_addresses
from proxyd.config import ConfigError, load
from proxyd.model import parse_endpoint_slice, parse_node, parse_service
from proxyd.policy.model import InvalidObject, parse_pod, parse_policy

HOSTILE = "fe80::1%a\nflush ruleset"
HOSTILE_CIDR = "fe80::%x;y/64"


@pytest.mark.parametrize("parse", [ip_text.address, ip_text.network, ip_text.interface])
def test_scope_ids_and_non_text_are_refused(parse: Any) -> None:
    for value in (HOSTILE, HOSTILE_CIDR, "fe80::1%eth0", 5, None):
        with pytest.raises(ValueError):
            parse(value)


def test_what_is_read_is_written_canonical() -> None:
    assert str(ip_text.address("FD00:0:0::0001")) == "fd00::1"
    assert str(ip_text.network(" 10.1.2.3/8 ")) == "10.0.0.0/8"
    assert str(ip_text.interface("fd00::5/64")) == "fd00::5/64"
    with pytest.raises(ValueError):
        ip_text.network("10.1.2.3/8", strict=True)


def test_a_node_address_with_a_scope_id_is_left_out_and_never_a_nodeport_address() -> None:
    node = parse_node(
        {
            "metadata": {"name": "n1"},
            "status": {
                "addresses": [
                    {"type": "InternalIP", "address": HOSTILE},
                    {"type": "InternalIP", "address": "fd00::10"},
                ]
            },
        }
    )
    assert node.addresses == ("fd00::10",)
    assert nodeport_addresses(("primary",), 6, node, lambda: ()) == ("fd00::10",)


def test_service_and_endpoint_addresses_with_a_scope_id_are_left_out() -> None:
    (port,) = parse_service(
        {
            "metadata": {"namespace": "ns", "name": "s"},
            "spec": {
                "clusterIPs": ["fd00::10"],
                "externalIPs": [HOSTILE, "2001:db8::7"],
                "ports": [{"port": 80}],
            },
        }
    )
    assert port.external_ips == ("2001:db8::7",)
    slice_ = parse_endpoint_slice(
        {
            "metadata": {
                "namespace": "ns",
                "name": "s-1",
                "labels": {"kubernetes.io/service-name": "s"},
            },
            "addressType": "IPv6",
            "ports": [{"port": 80}],
            "endpoints": [{"addresses": [HOSTILE]}, {"addresses": ["fd10::5"]}],
        }
    )
    assert slice_ is not None and [e.ip for e in slice_.endpoints] == ["fd10::5"]


def test_a_pod_ip_or_ip_block_with_a_scope_id_is_not_understood() -> None:
    with pytest.raises(InvalidObject):
        parse_pod(
            {
                "metadata": {"namespace": "ns", "name": "p"},
                "spec": {"nodeName": "n1"},
                "status": {"phase": "Running", "podIPs": [{"ip": HOSTILE}]},
            }
        )
    policy = parse_policy(
        {
            "metadata": {"namespace": "ns", "name": "p"},
            "spec": {
                "podSelector": {},
                "ingress": [{"from": [{"ipBlock": {"cidr": HOSTILE_CIDR}}]}],
            },
        }
    )
    assert policy.ingress == () and "not a CIDR" in policy.problems[0]


def test_a_plugin_result_with_a_scope_id_is_a_decode_failure() -> None:
    for ips, routes in (
        ([{"address": "fe80::5%x;y/64"}], []),
        ([{"address": "fd00::5/64", "gateway": HOSTILE}], []),
        ([], [{"dst": HOSTILE_CIDR}]),
    ):
        with pytest.raises(CniError) as raised:
            Result.from_json({"cniVersion": "1.1.0", "ips": ips, "routes": routes})
        assert raised.value.code == Code.DECODE_FAILURE


def test_a_nodeport_address_flag_with_a_scope_id_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        load(["--nodeport-addresses", HOSTILE_CIDR])


@pytest.mark.parametrize(
    "text",
    [
        "10.244.1.5",
        "0.0.0.0",
        "255.255.255.255",
        "010.244.1.5",
        "10.244.1",
        " 10.244.1.5",
        "10.244.1.5\n",
        "10.244.1.5\x00",
        "fd00:0::1",
        "::ffff:10.244.1.5",
        HOSTILE,
        "",
        7,
        None,
    ],
)
def test_address_text_is_the_canonical_text_of_what_address_reads(text: object) -> None:
    try:
        expected = str(ip_text.address(text))
    except ValueError:
        with pytest.raises(ValueError):
            ip_text.address_text(text)
    else:
        assert ip_text.address_text(text) == expected
