"""Bridge mode through netlink: the node bridge, the pod's veth pair, its addresses and routes."""

from __future__ import annotations

import errno
import functools
import hashlib
import ipaddress
import time

from cni import links
from cni.errors import CniError, Code
from cni.invocation import attaching
from cni.kernel import netns, sysctl
from cni.links import (
    IFF_PROMISC,
    IFF_UP,
    Link,
    addresses,
    delete_link,
    ignoring,
    link_by_name,
    netlink_errors,
)
from cni.netconf import IPV6_MIN_MTU, NetConf
from cni.result import Interface, IPAddress, IPConfig, IPInterface, Result, Route
from cni.routes import MAIN_TABLE, add_route, routes

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

HOST_VETH_PREFIX = "knit"
PORT_WAIT, PORT_POLL = 1.0, 0.0005
"""How long an ADD waits, polling, for the bridge to enable the new pod's port before it
announces the pod's addresses (seconds)."""
DEFAULT_ROUTES = {4: ipaddress.ip_network("0.0.0.0/0"), 6: ipaddress.ip_network("::/0")}


def host_veth_name(network: str, container_id: str, ifname: str) -> str:
    """Derived from the attachment, so DEL and GC find the veth without any saved state."""
    digest = hashlib.sha256(f"{network}/{container_id}/{ifname}".encode()).hexdigest()
    return HOST_VETH_PREFIX + digest[:11]


def gateway_interfaces(ips: list[IPConfig]) -> list[IPInterface]:
    """The bridge's side of each subnet: the IPAM gateway, or the subnet's first address."""
    found: list[IPInterface] = []
    for ip in ips:
        gateway = ip.gateway or ip.address.network.network_address + 1
        gateway_if = ipaddress.ip_interface(f"{gateway}/{ip.address.network.prefixlen}")
        if gateway_if not in found:
            found.append(gateway_if)
    return found


def container_routes(conf: NetConf, ipam: Result) -> list[Route]:
    """IPAM's routes with gateways filled in per family, plus default routes if asked for;
    a family's gateway is its first address's, as in the reference plugin."""
    gateways: dict[int, IPAddress] = {}
    for interface in gateway_interfaces(ipam.ips):
        gateways.setdefault(interface.version, interface.ip)
    filled = [Route(r.dst, r.gw or gateways.get(r.dst.version), r.extras) for r in ipam.routes]
    if conf.is_default_gateway:
        for version, gateway in gateways.items():
            default = DEFAULT_ROUTES[version]
            if not any(r.dst == default for r in filled):
                filled.append(Route(default, gateway))
    return filled


def ensure_bridge(conf: NetConf) -> Link:
    created = False
    with netlink_errors(f"cannot create bridge {conf.bridge}"):
        if link_by_name(conf.bridge) is None:
            ignoring(
                errno.EEXIST,
                functools.partial(links.create_bridge, conf.bridge, vlan_filtering=bool(conf.vlan)),
            )
            created = True
    bridge = link_by_name(conf.bridge)
    if bridge is None or bridge.kind != "bridge":
        raise CniError(Code.INVALID_NETWORK_CONFIG, f"{conf.bridge} exists and is not a bridge")
    with netlink_errors(f"cannot configure bridge {conf.bridge}"):
        promisc = conf.promisc_mode and not bridge.flags & IFF_PROMISC
        up = not bridge.flags & IFF_UP
        mtu = 0
        if conf.mtu and bridge.mtu != conf.mtu:
            # the bridge is every pod's: an MTU under IPv6's minimum would turn IPv6 off on it
            global6 = [a for a in addresses(bridge.index) if a.version == 6 and not a.is_link_local]
            if conf.mtu < IPV6_MIN_MTU and global6:
                raise CniError(
                    Code.INVALID_NETWORK_CONFIG,
                    f"mtu {conf.mtu} would turn IPv6 off on bridge {conf.bridge}, which has "
                    "IPv6 addresses",
                )
            mtu = conf.mtu
        if up or promisc or mtu:
            links.set_link(bridge.index, up=up, promisc=promisc, mtu=mtu)
        if created:
            keep_mac(bridge)
    return bridge


def keep_mac(bridge: Link) -> None:
    """Make the kernel keep the bridge's MAC. A bridge whose MAC was never set takes the lowest
    MAC among its ports and changes it as pods come and go; the pods that cached the gateway's
    old MAC then have their frames bridged rather than routed until their neighbour entry
    expires (30-60 s). Setting it, even to itself, fixes it. Only when the bridge is made or
    given an address, as the reference plugin does: setting a MAC flushes every neighbour
    entry on the device, the node's entries for every pod on the bridge."""
    links.set_link(bridge.index, mac=bridge.mac)


def ensure_gateway_addresses(bridge: Link, gateways: list[IPInterface], force: bool) -> None:
    present = addresses(bridge.index)
    for gateway in gateways:
        if gateway in present:
            continue
        clashing = [
            a
            for a in present
            if a.version == gateway.version and a.network.overlaps(gateway.network)
        ]
        if clashing and not force:
            raise CniError(
                Code.INVALID_NETWORK_CONFIG,
                f"bridge {bridge.name} already has {clashing[0]}, not {gateway} "
                "(forceAddress replaces it)",
            )
        with netlink_errors(f"cannot set {gateway} on bridge {bridge.name}"):
            for old in clashing:
                links.delete_address(bridge.index, old)
            ignoring(errno.EEXIST, functools.partial(links.add_address, bridge.index, gateway))
            keep_mac(bridge)


def enable_forwarding(ips: list[IPConfig]) -> None:
    for version in sorted({ip.address.version for ip in ips}):
        sysctl.write("net/ipv4/ip_forward" if version == 4 else "net/ipv6/conf/all/forwarding", "1")


def create_veth(conf: NetConf, host_name: str, ifname: str, netns_fd: int, mac: str) -> None:
    delete_link(host_name)  # a stale pair of an earlier, interrupted ADD
    with netlink_errors(f"cannot create veth {host_name}"):
        links.create_veth(host_name, ifname, netns_fd, conf.mtu or 0, mac)


def forget_neighbours(bridge: Link, ips: list[IPConfig]) -> None:
    """Delete the node's neighbour entries for the pod's addresses on the bridge, once its
    policies are in the kernel and before it can answer. Packets the node routes to an address
    it cannot resolve wait in the entry, and passed the policy hook when they were queued:
    before the pod existed, so unjudged by what isolates it. The pod's first ARP answer or
    announcement would deliver them. Deleting the entry drops them (and an entry naming the
    MAC of the address's last pod)."""
    with netlink_errors(f"cannot forget neighbours on {bridge.name}"):
        for ip in ips:
            links.delete_neighbour(bridge.index, ip.address.ip)


def attach_to_bridge(conf: NetConf, host: Link, bridge: Link) -> None:
    with netlink_errors(f"cannot attach {host.name} to {bridge.name}"):
        links.set_link(host.index, up=True, master=bridge.index)
        if conf.hairpin_mode:
            links.set_hairpin(host.index)
        if conf.vlan:
            links.set_port_vlan(host.index, conf.vlan)


def configure_container(
    netns_fd: int, conf: NetConf, ifname: str, ips: list[IPConfig], route_list: list[Route]
) -> Link:
    """Addresses, link state and routes inside the pod; returns the pod's interface."""
    with netns.entered(netns_fd):
        link = link_by_name(ifname)
        if link is None:
            raise CniError(Code.NETLINK_FAILURE, f"{ifname} vanished from the container")
        if any(ip.address.version == 6 for ip in ips):
            sysctl.write(sysctl.interface_key("ipv6", ifname, "disable_ipv6"), "0")
            sysctl.write(
                sysctl.interface_key("ipv6", ifname, "accept_dad"), "1" if conf.enable_dad else "0"
            )
            sysctl.write(sysctl.interface_key("ipv6", ifname, "ndisc_notify"), "1")
        if any(ip.address.version == 4 for ip in ips):
            sysctl.write(sysctl.interface_key("ipv4", ifname, "arp_notify"), "1")
        with netlink_errors(f"cannot configure {ifname} in the container"):
            for ip in ips:
                links.add_address(link.index, ip.address)
            links.set_link(link.index, up=True)
            for route in route_list:
                add_route(route, link.index)
        return link


def announce(netns_fd: int, host: Link, container: Link) -> None:
    """Tell the pod's neighbours on the bridge (the node and the other pods) its MAC, for each
    of its addresses, so that an entry still naming an earlier holder of an address (a pod
    deleted a moment ago) is overridden at once: left alone, a REACHABLE entry is trusted for
    15-45 s, and a STALE one is probed only 5 s after its next use, the frames going to the
    old MAC meanwhile.

    The kernel does it: with arp_notify and ndisc_notify on (configure_container), a change of
    the pod interface's MAC sends a gratuitous ARP request for each IPv4 address and an
    unsolicited neighbour advertisement, override flag set, for each IPv6 address that is not
    tentative; setting the MAC to itself is such a change. Those the kernel sends when the
    link comes up are lost: the bridge drops the port's frames until its link watch sees the
    carrier and enables the port, after the link's request has returned. So this waits for
    that (DISABLED only: a port that STP holds back is STP's), then sets the MAC. An address
    under DAD (enabledad) is announced by the kernel when DAD completes, the port long
    enabled by then."""
    deadline = time.monotonic() + PORT_WAIT
    with netlink_errors(f"cannot announce {container.name}'s addresses"):
        while (
            links.port_state(host.name) == links.BR_STATE_DISABLED and time.monotonic() < deadline
        ):
            time.sleep(PORT_POLL)
        with netns.entered(netns_fd):
            links.set_link(container.index, mac=container.mac)


def container_has_interface(netns_fd: int, ifname: str) -> bool:
    with netns.entered(netns_fd):
        return link_by_name(ifname) is not None


def delete_container_interface(netns_fd: int, ifname: str) -> None:
    with netns.entered(netns_fd):
        delete_link(ifname)


def setup(
    conf: NetConf,
    container_id: str,
    ifname: str,
    netns_path: str,
    netns_fd: int,
    ipam: Result,
    mac: str,
) -> Result:
    """Everything on the node and in the pod for one attachment; the caller rolls back."""
    host_name = host_veth_name(conf.name, container_id, ifname)
    gateways = gateway_interfaces(ipam.ips)
    route_list = container_routes(conf, ipam)
    bridge = ensure_bridge(conf)
    if conf.is_gateway:
        ensure_gateway_addresses(bridge, gateways, conf.force_address)
    create_veth(conf, host_name, ifname, netns_fd, mac)
    host = link_by_name(host_name)
    if host is None:
        raise CniError(Code.NETLINK_FAILURE, f"veth {host_name} vanished")
    admit = attaching.get()
    if admit is not None:
        admit(tuple(str(ip.address.ip) for ip in ipam.ips))
    forget_neighbours(bridge, ipam.ips)
    attach_to_bridge(conf, host, bridge)
    bridge = link_by_name(conf.bridge) or bridge
    container = configure_container(netns_fd, conf, ifname, ipam.ips, route_list)
    if ipam.ips:
        announce(netns_fd, host, container)
    if conf.is_gateway:
        enable_forwarding(ipam.ips)
    interfaces = [
        Interface(bridge.name, bridge.mac),
        Interface(host.name, host.mac),
        Interface(container.name, container.mac, sandbox=netns_path, mtu=container.mtu),
    ]
    ips = [IPConfig(ip.address, ip.gateway, interface=2) for ip in ipam.ips]
    dns = ipam.dns if conf.dns is None else conf.dns
    return Result(interfaces=interfaces, ips=ips, routes=route_list, dns=dns)


def check(conf: NetConf, ifname: str, netns_path: str, netns_fd: int, prev: Result) -> None:
    """Compare the kernel with prevResult; raise naming the first thing that differs."""
    bridge = link_by_name(conf.bridge)
    if bridge is None or bridge.kind != "bridge":
        check_failed(f"bridge {conf.bridge} is missing")
    host_names = [i.name for i in prev.interfaces if not i.sandbox and i.name != conf.bridge]
    if not host_names:
        check_failed("prevResult names no host veth")
    host = link_by_name(host_names[0])
    if host is None:
        check_failed(f"host veth {host_names[0]} is missing")
    if host.master != bridge.index:
        check_failed(f"host veth {host.name} is not attached to bridge {conf.bridge}")
    index, expected = next(
        ((n, i) for n, i in enumerate(prev.interfaces) if i.sandbox and i.name == ifname),
        (None, None),
    )
    if expected is None:
        check_failed(f"prevResult has no interface {ifname} in {netns_path}")
    with netns.entered(netns_fd):
        link = link_by_name(ifname)
        if link is None:
            check_failed(f"container interface {ifname} is missing")
        if link.kind != "veth":
            check_failed(f"container interface {ifname} is a {link.kind or 'device'}, not a veth")
        if expected.mac and link.mac.lower() != expected.mac.lower():
            check_failed(f"container interface {ifname} has MAC {link.mac}, not {expected.mac}")
        present = addresses(link.index)
        for ip in prev.ips:
            if ip.interface in (None, index) and ip.address not in present:
                check_failed(f"address {ip.address} is missing from {ifname}")
        for route in prev.routes:
            installed = routes(link.index, route.extras.get("table", MAIN_TABLE))
            if not any(
                dst == route.dst and (route.gw is None or gw == str(route.gw))
                for dst, gw in installed
            ):
                via = f" via {route.gw}" if route.gw else ""
                check_failed(f"route to {route.dst}{via} is missing from {ifname}")


def check_failed(what: str) -> NoReturn:
    raise CniError(Code.CHECK_FAILED, f"CHECK failed: {what}")
