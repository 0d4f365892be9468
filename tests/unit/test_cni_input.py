"""The one layer that checks names and paths taken from a network config (cni.paths)."""

from __future__ import annotations

import pytest

from cni import netconf
from cni.errors import CniError, Code
from cni.invocation import from_environ
from cni.ipam.hostlocal import parse_conf
from cni.paths import check_network_name, check_plugin_name, inside, narrowed_search_path

BASE = {"cniVersion": "1.1.0", "name": "net", "type": "knit"}


@pytest.mark.parametrize("name", ["knit", "k8s-pod-network", "net_1.2", "0net"])
def test_network_names_the_spec_allows(name):
    assert check_network_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "../x", "/abs", "a/b", ".", "..", "-x", "_x", "x\0", "x y", "é", "n" * 256, 7]
)
def test_network_names_the_spec_forbids_are_invalid_config(name):
    with pytest.raises(CniError) as err:
        netconf.parse({**BASE, "name": name})
    assert err.value.code == 7


@pytest.mark.parametrize("plugin", ["/bin/sh", "../sh", "a/b", ".", "..", "x\0", 3, ["x"]])
def test_an_ipam_type_must_be_a_plugin_name(plugin):
    with pytest.raises(CniError) as err:
        netconf.parse({**BASE, "ipam": {"type": plugin}})
    assert err.value.code == 7
    assert "ipam.type" in err.value.msg


def test_plugin_names_from_cni_path_are_taken():
    assert check_plugin_name("host-local", "ipam.type") == "host-local"
    assert netconf.parse({**BASE, "ipam": {"type": "dhcp"}}).ipam == {"type": "dhcp"}


@pytest.mark.parametrize("component", ["", ".", "..", "a/b", "../x", "x\0"])
def test_inside_refuses_anything_but_one_component(tmp_path, component):
    with pytest.raises(CniError) as err:
        inside(tmp_path, component)
    assert err.value.code == 7


@pytest.mark.parametrize("field", ["dataDir", "resolvConf"])
@pytest.mark.parametrize("value", [5, ["/x"], {"a": 1}, "/tmp/x\0y"])
def test_host_local_directories_must_be_path_strings(field, value):
    ipam = {"type": "host-local", "subnet": "10.1.0.0/24", field: value}
    with pytest.raises(CniError) as err:
        parse_conf({**BASE, "ipam": ipam}, "net", {})
    assert err.value.code == 7
    assert f"ipam.{field}" in err.value.msg


HOST_LOCAL = {"type": "host-local", "subnet": "10.1.0.0/24"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("args", "x"),
        ("args", {"cni": 5}),
        ("args", {"cni": {"ips": "10.1.0.5"}}),
        ("args", {"cni": {"ips": [5]}}),
        ("args", {"cni": {"mac": 5}}),
        ("runtimeConfig", "x"),
        ("runtimeConfig", {"ips": 5}),
        ("runtimeConfig", {"mac": ["x"]}),
        ("runtimeConfig", {"ipRanges": [{"subnet": "10.2.0.0/24"}]}),
        ("capabilities", []),
        ("prevResult", "x"),
    ],
)
def test_runtime_fields_of_the_wrong_shape_are_invalid_config_naming_the_field(field, value):
    with pytest.raises(CniError) as err:
        netconf.parse({**BASE, "ipam": HOST_LOCAL, field: value})
    assert err.value.code == 7
    assert err.value.msg.startswith(field)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("subnet", 5),
        ("gateway", ["10.1.0.1"]),
        ("rangeStart", {"a": 1}),
        ("ranges", [{"subnet": "10.1.0.0/24"}]),
        ("ranges", [[{"subnet": "10.1.0.0/24"}, "x"]]),
        ("ranges", "10.1.0.0/24"),
        ("routes", [["0.0.0.0/0"]]),
        ("routes", {"dst": "0.0.0.0/0"}),
    ],
)
def test_host_local_fields_of_the_wrong_shape_are_invalid_config(field, value):
    raw = {**BASE, "ipam": {**HOST_LOCAL, field: value}}
    with pytest.raises(CniError) as err:
        parse_conf(raw, "net", {})
    assert err.value.code == 7
    assert err.value.msg.startswith(f"ipam.{field}")


@pytest.mark.parametrize("field", ["args", "runtimeConfig", "capabilities", "prevResult"])
def test_a_null_runtime_field_is_absent(field):
    assert netconf.parse({**BASE, field: None}).name == "net"


@pytest.mark.parametrize(
    ("mtu", "ipam", "problem"),
    [
        (70000, HOST_LOCAL, "above 65535"),
        (1000, {"type": "host-local", "subnet": "fd00::/64"}, "below IPv6's minimum"),
        (1279, {"type": "host-local", "ranges": [[{"subnet": "fd00::/64"}]]}, "IPv6"),
    ],
)
def test_an_mtu_the_network_cannot_carry_is_refused(mtu, ipam, problem):
    with pytest.raises(CniError) as err:
        netconf.parse({**BASE, "ipam": ipam, "mtu": mtu})
    assert err.value.code == 7
    assert problem in err.value.msg


def test_a_small_mtu_is_taken_for_an_ipv4_only_network():
    assert netconf.parse({**BASE, "ipam": HOST_LOCAL, "mtu": 1000}).mtu == 1000


@pytest.mark.parametrize("bridge", ["", "br 0", "br:0", "br\t0", ".", "..", "a/b", "b" * 16, "x\0"])
def test_a_bridge_name_the_kernel_would_refuse_is_invalid_config(bridge):
    with pytest.raises(CniError) as err:
        netconf.parse({**BASE, "bridge": bridge})
    assert err.value.code == 7
    assert "bridge name" in err.value.msg


ATTACHMENT = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_NETNS": "/var/run/netns/p"}


@pytest.mark.parametrize(
    "ifname",
    [
        'eth"0',
        "eth'0",
        "eth;0",
        "eth\\0",
        "a/b",
        "eth:0",
        "eth 0",
        "eth\t0",
        "eth\x01",
        ".",
        "e" * 16,
    ],
)
def test_an_ifname_outside_the_kernels_characters_less_quotes_is_code_4(ifname):
    """CNI_IFNAME ends up inside the quoted comment of an iptables or nftables rule (the
    attachment's tag): a quote there would end the comment and write rule text."""
    with pytest.raises(CniError) as err:
        from_environ({**ATTACHMENT, "CNI_IFNAME": ifname})
    assert err.value.code == Code.INVALID_ENV
    assert err.value.msg.startswith("CNI_IFNAME")


@pytest.mark.parametrize("ifname", ["eth0", "net1", "veth-a.b_c", "e" * 15, "pod@1", "ifé"])
def test_an_ifname_of_the_kernels_characters_is_taken(ifname):
    assert from_environ({**ATTACHMENT, "CNI_IFNAME": ifname}).ifname == ifname


@pytest.mark.parametrize("bridge", ['br"0', "br;0"])
def test_a_bridge_name_with_a_quote_is_invalid_config(bridge):
    with pytest.raises(CniError) as err:
        netconf.parse({**BASE, "bridge": bridge})
    assert err.value.code == 7


@pytest.mark.parametrize(
    ("requested", "narrowed"),
    [
        ("/opt/cni/bin", "/opt/cni/bin"),
        ("/tmp/x:/opt/cni/bin/", "/opt/cni/bin"),
        ("/usr/lib/cni:/tmp/x:/opt/cni/bin", "/usr/lib/cni:/opt/cni/bin"),
        ("/opt/cni/bin/../../../tmp", ""),
        ("/opt/cni/bin/sub:opt/cni/bin:/opt", ""),
        ("", ""),
    ],
)
def test_a_search_path_is_only_narrowed(requested, narrowed):
    assert narrowed_search_path(requested, ["/opt/cni/bin", "/usr/lib/cni"]) == narrowed
