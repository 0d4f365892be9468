"""The plugin's verbs: a CNI call, read from the environment and stdin (in-process, through
cni.in_process) or handed over by the node daemon (cni.server), run, and its result or error
JSON printed. The executable the runtime starts is the compiled client, cni/client.c."""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable, Collection, Mapping

from cni import ipam as ipam_module
from cni import netconf, version
from cni.errors import CniError, Code
from cni.invocation import Invocation, from_environ, parse_stdin
from cni.kernel.errors import FirewallError, KernelError, NetnsError
from cni.netconf import NetConf
from cni.result import Result

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAC_PATTERN = re.compile(r"([0-9a-fA-F]{2}:){5}[0-9a-fA-F]{2}")


def run(invocation: Invocation, stdin: bytes) -> dict[str, Any] | None:
    """Serve one call; returns the JSON to print, if the verb prints any."""
    if invocation.command == "VERSION":
        return version_answer(stdin)
    raw = parse_stdin(stdin)
    verbs: dict[str, Callable[[Invocation, dict[str, Any], bytes], dict[str, Any] | None]] = {
        "ADD": cmd_add,
        "DEL": cmd_del,
        "CHECK": cmd_check,
        "STATUS": cmd_status,
        "GC": cmd_gc,
    }
    return verbs[invocation.command](invocation, raw, stdin)


def version_answer(stdin: bytes) -> dict[str, Any]:
    """The version the runtime asked in (the latest when it named none) and those we speak."""
    try:
        asked = json.loads(stdin or b"{}").get("cniVersion")
    except (ValueError, AttributeError):
        asked = None
    if asked is not None and not isinstance(asked, str):
        raise CniError(Code.INVALID_NETWORK_CONFIG, "VERSION needs a string cniVersion")
    return {
        "cniVersion": asked or version.LATEST,
        "supportedVersions": list(version.SUPPORTED_VERSIONS),
    }


def _requested_mac(raw: dict[str, Any], cni_args: dict[str, str]) -> str:
    """runtimeConfig.mac, else args.cni.mac, else CNI_ARGS MAC=: the reference bridge's order."""
    mac = (
        (raw.get("runtimeConfig") or {}).get("mac")
        or (((raw.get("args") or {}).get("cni") or {}).get("mac"))
        or ""
    )
    if not mac:
        return _cni_args_mac(cni_args)
    if not (isinstance(mac, str) and MAC_PATTERN.fullmatch(mac)):
        raise CniError(Code.INVALID_NETWORK_CONFIG, f"requested MAC {mac!r} is not a MAC address")
    return mac


def _cni_args_mac(cni_args: dict[str, str]) -> str:
    mac = cni_args.get("MAC", "")
    if mac and not MAC_PATTERN.fullmatch(mac):
        raise CniError(Code.INVALID_ENV, f"CNI_ARGS: MAC {mac!r} is not a MAC address")
    return mac


def cni_error(err: KernelError) -> CniError:
    """The kernel layer's failure as the CNI error the plugin reports: a firewall's 103, a
    namespace gone 3 (the container is), any other 5."""
    if isinstance(err, FirewallError):
        code = Code.FIREWALL_FAILURE
    elif isinstance(err, NetnsError) and err.gone:
        code = Code.UNKNOWN_CONTAINER
    else:
        code = Code.IO_FAILURE
    return CniError(code, err.msg, err.details)


def _best_effort(steps: list[Callable[[], None]]) -> list[CniError]:
    """Run every step even when some fail; return what failed."""
    failures = []
    for step in steps:
        try:
            step()
        except CniError as err:
            failures.append(err)
        except KernelError as err:
            failures.append(cni_error(err))
        except Exception as err:
            failures.append(CniError(Code.UNEXPECTED, f"{type(err).__name__}: {err}"))
    return failures


def _firewall_teardown(
    conf: NetConf, container_id: str, ifname: str, families: Collection[int]
) -> list[Callable[[], None]]:
    # The firewall's modules (and subprocess, which they import) only for an attachment that
    # has rules: most have none, and an in-process call pays for every import.
    steps: list[Callable[[], None]] = []
    if conf.ip_masq:
        from cni import masq
        from cni.kernel.firewall import attachment_selector

        masq_rules = attachment_selector(masq.KIND, conf.name, container_id, ifname)
        steps.append(lambda: masq.teardown([conf.ip_masq_backend], masq_rules, families))
    if conf.mac_spoof_check:
        from cni import spoofcheck
        from cni.kernel.firewall import attachment_selector

        spoofchk_rules = attachment_selector(spoofcheck.KIND, conf.name, container_id, ifname)
        steps.append(lambda: spoofcheck.teardown(spoofchk_rules))
    return steps


def cmd_add(invocation: Invocation, raw: dict[str, Any], stdin: bytes) -> dict[str, Any]:
    from cni import bridge
    from cni.kernel import netns

    conf = netconf.parse(raw)
    mac = _requested_mac(raw, invocation.args)
    ipam = ipam_module.for_config(raw, stdin, invocation)
    cid, ifname = invocation.container_id, invocation.ifname
    netns_fd = netns.open_netns(invocation.netns, invocation.netns_fd)
    try:
        if bridge.container_has_interface(netns_fd, ifname):
            raise CniError(
                Code.INTERFACE_EXISTS, f"interface {ifname} already exists in {invocation.netns}"
            )
        ipam_result = ipam.add(cid, ifname)
        host_veth = bridge.host_veth_name(conf.name, cid, ifname)
        try:
            result = bridge.setup(conf, cid, ifname, invocation.netns, netns_fd, ipam_result, mac)
            if conf.ip_masq:
                from cni import masq
                from cni.kernel.firewall import Tag

                masq.setup(
                    conf.ip_masq_backend,
                    Tag(masq.KIND, conf.name, cid, ifname),
                    [ip.address for ip in result.ips],
                )
            if conf.mac_spoof_check:
                from cni import spoofcheck
                from cni.kernel.firewall import Tag

                spoofcheck.setup(
                    Tag(spoofcheck.KIND, conf.name, cid, ifname),
                    host_veth,
                    result.interfaces[2].mac,
                )
        except BaseException:
            _best_effort(
                [
                    *_firewall_teardown(conf, cid, ifname, _families(ipam_result)),
                    lambda: _delete_attachment_links(conf, invocation, netns_fd),
                    lambda: ipam.release(cid, ifname),
                ]
            )
            raise
    finally:
        os.close(netns_fd)
    return result.to_json(conf.cni_version)


def _families(result: Result) -> set[int]:
    return {ip.address.version for ip in result.ips}


def _attachment_families(raw: dict[str, Any]) -> Collection[int]:
    """The address families the attachment has rules in: those of prevResult's addresses, or
    every family when the runtime passed no prevResult (or one that cannot be read)."""
    from cni.kernel.families import IP_FAMILIES

    try:
        return _families(Result.from_json(raw.get("prevResult")))
    except CniError:
        return IP_FAMILIES


def _delete_attachment_links(conf: NetConf, invocation: Invocation, netns_fd: int | None) -> None:
    from cni import bridge
    from cni.links import delete_link

    # the host end takes the pod's with it
    removed = delete_link(
        bridge.host_veth_name(conf.name, invocation.container_id, invocation.ifname)
    )
    if not removed and netns_fd is not None:
        bridge.delete_container_interface(netns_fd, invocation.ifname)


def cmd_del(invocation: Invocation, raw: dict[str, Any], stdin: bytes) -> None:
    from cni.kernel import netns

    conf = netconf.parse(raw)
    ipam = ipam_module.for_config(raw, stdin, invocation)
    cid, ifname = invocation.container_id, invocation.ifname
    netns_fd = None
    if invocation.netns:
        try:
            netns_fd = netns.open_netns(invocation.netns, invocation.netns_fd)
        except NetnsError:
            netns_fd = None
    try:
        failures = _best_effort(
            [
                *_firewall_teardown(conf, cid, ifname, _attachment_families(raw)),
                lambda: _delete_attachment_links(conf, invocation, netns_fd),
                lambda: ipam.release(cid, ifname),
            ]
        )
    finally:
        if netns_fd is not None:
            os.close(netns_fd)
    if failures:
        raise failures[0]


def cmd_check(invocation: Invocation, raw: dict[str, Any], stdin: bytes) -> None:
    from cni import bridge
    from cni.kernel import netns

    conf = netconf.parse(raw)
    if not version.at_least(conf.cni_version, "0.4.0"):
        raise CniError(Code.INCOMPATIBLE_VERSION, "CHECK needs cniVersion 0.4.0 or later")
    if not isinstance(raw.get("prevResult"), dict):
        raise CniError(Code.INVALID_NETWORK_CONFIG, "CHECK needs a prevResult")
    prev = Result.from_json(raw["prevResult"])
    ipam_module.for_config(raw, stdin, invocation).check(invocation.container_id, invocation.ifname)
    netns_fd = netns.open_netns(invocation.netns, invocation.netns_fd)
    try:
        bridge.check(conf, invocation.ifname, invocation.netns, netns_fd, prev)
    finally:
        os.close(netns_fd)
    if conf.ip_masq:
        _check_masq(conf, invocation.container_id, invocation.ifname, prev)


def _check_masq(conf: NetConf, container_id: str, ifname: str, prev: Result) -> None:
    """The attachment's masquerade rules, in the node's namespace, for prevResult's addresses."""
    from cni import bridge, masq
    from cni.kernel.firewall import Tag, attachment_selector

    select = attachment_selector(masq.KIND, conf.name, container_id, ifname)
    addresses = [ip.address for ip in prev.ips]
    if not masq.present(conf.ip_masq_backend, select, addresses):
        tag = Tag(masq.KIND, conf.name, container_id, ifname)
        listed = ", ".join(str(address) for address in addresses)
        bridge.check_failed(
            f'{conf.ip_masq_backend} masquerade rule "{tag}" for {listed} is missing'
        )


def cmd_status(invocation: Invocation, raw: dict[str, Any], stdin: bytes) -> None:
    conf = netconf.parse(raw)
    if not version.at_least(conf.cni_version, "1.1.0"):
        raise CniError(Code.INCOMPATIBLE_VERSION, "STATUS needs cniVersion 1.1.0 or later")
    ipam_module.for_config(raw, stdin, invocation).status()


def valid_attachments(raw: dict[str, Any]) -> set[tuple[str, str]]:
    entries = raw.get("cni.dev/valid-attachments", raw.get("cni.dev/attachments"))
    if not isinstance(entries, list):
        raise CniError(Code.INVALID_NETWORK_CONFIG, "GC needs cni.dev/valid-attachments")
    try:
        return {(str(e["containerID"]), str(e["ifname"])) for e in entries}
    except (KeyError, TypeError) as err:
        raise CniError(Code.INVALID_NETWORK_CONFIG, f"bad valid-attachments entry: {err}") from err


def cmd_gc(invocation: Invocation, raw: dict[str, Any], stdin: bytes) -> None:
    from cni import masq, spoofcheck
    from cni.kernel.families import IP_FAMILIES
    from cni.kernel.firewall import stale_selector

    conf = netconf.parse(raw)
    if not version.at_least(conf.cni_version, "1.1.0"):
        raise CniError(Code.INCOMPATIBLE_VERSION, "GC needs cniVersion 1.1.0 or later")
    valid = valid_attachments(raw)
    ipam = ipam_module.for_config(raw, stdin, invocation)
    failures = _best_effort(
        [
            lambda: ipam.gc(valid),
            lambda: masq.teardown(
                netconf.MASQ_BACKENDS, stale_selector(masq.KIND, conf.name, valid), IP_FAMILIES
            ),
            lambda: spoofcheck.teardown(stale_selector(spoofcheck.KIND, conf.name, valid)),
        ]
    )
    if failures:
        raise CniError(
            failures[0].code,
            "GC: " + "; ".join(f.msg for f in failures),
            "\n".join(f.details for f in failures if f.details),
        )


def execute(
    environ: Mapping[str, str], stdin: bytes, netns_fd: int | None = None
) -> tuple[int, bytes]:
    """One call, from its CNI_* variables and stdin to (exit code, what it prints).

    The executable's in-process path and the node daemon's fast path (cni.server) both come
    here, so the two give the same answer byte for byte. netns_fd is CNI_NETNS opened by the
    fast path's plugin; it stays the caller's to close.
    """
    try:
        answer = run(from_environ(environ, netns_fd), stdin)
    except CniError as err:
        return 1, error_output(err, stdin)
    except KernelError as err:
        return 1, error_output(cni_error(err), stdin)
    except Exception as err:
        import traceback

        failure = CniError(Code.UNEXPECTED, f"{type(err).__name__}: {err}", traceback.format_exc())
        return 1, error_output(failure, stdin)
    return 0, b"" if answer is None else encode(answer)


def error_output(err: CniError, stdin: bytes) -> bytes:
    """The error JSON as printed, in the call's cniVersion when we speak it, else the latest."""
    try:
        asked = json.loads(stdin).get("cniVersion")
    except (ValueError, AttributeError, RecursionError):
        asked = None
    return encode(err.to_json(asked if asked in version.SUPPORTED_VERSIONS else version.LATEST))


def main(environ: Mapping[str, str] | None = None) -> None:
    code, output = execute(os.environ if environ is None else environ, sys.stdin.buffer.read())
    sys.stdout.buffer.write(output)
    sys.stdout.flush()
    if code:
        sys.exit(code)


def encode(answer: dict[str, Any]) -> bytes:
    return (json.dumps(answer) + "\n").encode()
