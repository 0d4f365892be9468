"""Env parsing, config validation and versioned results: the parts of the spec that need no
kernel."""

from __future__ import annotations

import json

import pytest

from cni import netconf, plugin, version
from cni.errors import CniError, Code
from cni.invocation import from_environ, parse_cni_args
from cni.kernel.firewall import Tag
from cni.result import DNS, Result

BASE_ENV = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "abc", "CNI_NETNS": "/x", "CNI_IFNAME": "eth0"}
PREV = {
    "cniVersion": "0.4.0",
    "interfaces": [{"name": "eth0", "mac": "aa:bb:cc:dd:ee:ff", "sandbox": "/x", "mtu": 1400}],
    "ips": [{"version": "4", "address": "10.0.0.2/24", "gateway": "10.0.0.1", "interface": 0}],
    "routes": [{"dst": "0.0.0.0/0", "gw": "10.0.0.1", "priority": 5}],
    "dns": {"nameservers": ["10.0.0.10"]},
}


@pytest.mark.parametrize("missing", ["CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"])
def test_add_names_the_missing_variable(missing):
    env = {k: v for k, v in BASE_ENV.items() if k != missing}
    with pytest.raises(CniError) as err:
        from_environ(env)
    assert err.value.code == Code.INVALID_ENV
    assert missing in err.value.msg


def test_del_accepts_an_empty_netns():
    assert from_environ({**BASE_ENV, "CNI_COMMAND": "DEL", "CNI_NETNS": ""}).netns == ""


@pytest.mark.parametrize("ifname", ["a" * 16, "é" * 8, ".", "..", "a/b", "a:b", "a b"])
def test_bad_ifnames(ifname):
    with pytest.raises(CniError) as err:
        from_environ({**BASE_ENV, "CNI_IFNAME": ifname})
    assert err.value.code == Code.INVALID_ENV


def test_an_ifname_of_15_bytes_is_accepted():
    assert from_environ({**BASE_ENV, "CNI_IFNAME": "a" + "é" * 7}).ifname == "a" + "é" * 7


@pytest.mark.parametrize("container_id", ["-bad", "abc\n", "a b"])
def test_bad_container_id(container_id):
    with pytest.raises(CniError, match="CNI_CONTAINERID") as err:
        from_environ({**BASE_ENV, "CNI_CONTAINERID": container_id})
    assert err.value.code == Code.INVALID_ENV


def test_cni_args_need_ignore_unknown_for_unknown_keys():
    containerd = (
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME=web;"
        "K8S_POD_INFRA_CONTAINER_ID=abc;K8S_POD_UID=u1;FOO=bar"
    )
    assert parse_cni_args(containerd)["K8S_POD_NAME"] == "web"
    assert parse_cni_args("K8S_POD_NAME=web;IP=10.0.0.9")["IP"] == "10.0.0.9"
    with pytest.raises(CniError, match="FOO"):
        parse_cni_args("K8S_POD_NAME=web;FOO=bar")
    with pytest.raises(CniError, match="FOO"):
        from_environ({**BASE_ENV, "CNI_ARGS": "FOO=bar"})


@pytest.mark.parametrize("command", ["VERSION", "STATUS", "GC"])
def test_verbs_without_an_attachment_ignore_cni_args(command):
    invocation = from_environ({"CNI_COMMAND": command, "CNI_ARGS": "FOO=bar;not-a-pair"})
    assert invocation.args == {}


def test_version_answers_whatever_cni_args_hold():
    code, output = plugin.execute(
        {"CNI_COMMAND": "VERSION", "CNI_ARGS": "FOO=bar"}, b'{"cniVersion": "0.4.0"}'
    )
    assert code == 0 and json.loads(output)["cniVersion"] == "0.4.0"


@pytest.mark.parametrize("asked", ["5", '["1.0.0"]', '{"v": "1.0.0"}'])
def test_version_refuses_a_cni_version_that_is_not_a_string(asked):
    stdin = b'{"cniVersion": %s}' % asked.encode()
    code, output = plugin.execute({"CNI_COMMAND": "VERSION"}, stdin)
    assert code == 1
    assert json.loads(output) == {
        "cniVersion": version.LATEST,
        "code": Code.INVALID_NETWORK_CONFIG,
        "msg": "VERSION needs a string cniVersion",
    }


def conf(**options):
    return {
        "cniVersion": "1.0.0",
        "name": "n",
        "type": "knit",
        "ipam": {"type": "host-local"},
        **options,
    }


@pytest.mark.parametrize(
    ("mac", "message"),
    [
        ("aa:bb:cc:dd:ee:ff\n", "requested MAC 'aa:bb:cc:dd:ee:ff\\n' is not a MAC address"),
        ("aa:bb:cc:dd:ee", "requested MAC 'aa:bb:cc:dd:ee' is not a MAC address"),
        (5, "runtimeConfig.mac must be a string"),
    ],
)
def test_a_requested_mac_must_be_a_whole_mac_address(mac, message):
    stdin = json.dumps(conf(runtimeConfig={"mac": mac})).encode()
    code, output = plugin.execute(BASE_ENV, stdin)
    answer = json.loads(output)
    assert code == 1 and answer["code"] == Code.INVALID_NETWORK_CONFIG
    assert answer["msg"] == message


def test_unknown_option_is_named_with_code_2():
    with pytest.raises(CniError) as err:
        netconf.parse(conf(hairpinmode=True, promisc="on"))
    assert err.value.code == Code.UNSUPPORTED_FIELD
    assert err.value.msg == 'unknown option(s) hairpinmode=true, promisc="on"'


def test_a_bad_mac_in_cni_args_is_code_4():
    env = {**BASE_ENV, "CNI_ARGS": "MAC=aa:bb:cc:dd:ee"}
    code, output = plugin.execute(env, json.dumps(conf()).encode())
    answer = json.loads(output)
    assert code == 1 and answer["code"] == Code.INVALID_ENV
    assert answer["msg"] == "CNI_ARGS: MAC 'aa:bb:cc:dd:ee' is not a MAC address"


@pytest.mark.parametrize("ipam", [{}, {"type": ""}, "absent"])
def test_without_an_ipam_type_there_is_no_gateway_and_no_masquerade(ipam):
    raw = conf(isDefaultGateway=True, ipMasq=True, vlan=7)
    if ipam == "absent":
        del raw["ipam"]
    else:
        raw["ipam"] = ipam
    parsed = netconf.parse(raw)
    assert not (parsed.is_gateway or parsed.is_default_gateway or parsed.ip_masq)


@pytest.mark.parametrize(
    ("dns", "expected"),
    [
        (None, None),
        ({}, None),
        ({"domain": ""}, None),
        ({"nameservers": []}, DNS()),
        ({"domain": "cluster.local"}, DNS(domain="cluster.local")),
        (
            {"nameservers": ["10.96.0.10"], "search": ["svc"], "options": ["ndots:5"]},
            DNS(nameservers=["10.96.0.10"], search=["svc"], options=["ndots:5"]),
        ),
    ],
)
def test_the_configs_dns_counts_when_it_sets_a_field(dns, expected):
    assert netconf.parse(conf(dns=dns)).dns == expected


@pytest.mark.parametrize(
    "malformed",
    [
        {"ipam": {"type": 5}},
        {"ipam": []},
        {"ipam": None},
        {"dns": ["10.0.0.1"]},
        {"dns": {"nameservers": "10.0.0.1"}},
        {"dns": {"domain": 5}},
    ],
)
def test_an_ipam_or_dns_of_the_wrong_shape_is_code_7(malformed):
    with pytest.raises(CniError) as err:
        netconf.parse(conf(**malformed))
    assert err.value.code == Code.INVALID_NETWORK_CONFIG


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"hairpinMode": True, "promiscMode": True}, "cannot both be set"),
        ({"vlan": 5000}, "vlan 5000"),
        ({"vlan": 100, "isGateway": True}, "cannot be used with isGateway or isDefaultGateway"),
        ({"vlan": 100, "isDefaultGateway": True}, "out of the pods' reach"),
        ({"mtu": 10}, "mtu 10"),
        ({"ipMasqBackend": "pf"}, "ipMasqBackend"),
        ({"isGateway": "yes"}, "isGateway must be a bool"),
        ({"bridge": "a-very-long-bridge-name"}, "not a valid interface name"),
        ({"bridge": "é" * 8}, "not a valid interface name"),
    ],
)
def test_contradictory_or_bad_options_are_code_7(options, message):
    with pytest.raises(CniError) as err:
        netconf.parse(conf(**options))
    assert err.value.code == Code.INVALID_NETWORK_CONFIG
    assert message in err.value.msg


def test_unsupported_version_is_code_1():
    with pytest.raises(CniError) as err:
        netconf.parse({**conf(), "cniVersion": "0.2.0"})
    assert err.value.code == Code.INCOMPATIBLE_VERSION


def test_default_gateway_implies_gateway():
    parsed = netconf.parse(conf(isDefaultGateway=True))
    assert parsed.is_gateway and parsed.is_default_gateway


@pytest.mark.parametrize("version", ["0.3.0", "0.3.1", "0.4.0"])
def test_results_before_1_0_carry_ip_version(version):
    out = Result.from_json(PREV).to_json(version)
    assert out["cniVersion"] == version
    assert out["ips"][0]["version"] == "4"
    assert "mtu" not in out["interfaces"][0]
    assert "priority" not in out["routes"][0]


def test_result_1_0_drops_ip_version_and_1_1_adds_mtu_and_route_fields():
    result = Result.from_json(PREV)
    v100 = result.to_json("1.0.0")
    assert "version" not in v100["ips"][0]
    assert "mtu" not in v100["interfaces"][0]
    v110 = result.to_json("1.1.0")
    assert v110["interfaces"][0]["mtu"] == 1400
    assert v110["routes"][0] == {"dst": "0.0.0.0/0", "gw": "10.0.0.1", "priority": 5}
    assert v110["dns"] == {"nameservers": ["10.0.0.10"]}


def test_tags_round_trip():
    tag = Tag("masq", "net-1", "abc.def_1", "eth0")
    assert Tag.parse(f'-A POSTROUTING -m comment --comment "{tag}" -j X') == tag
