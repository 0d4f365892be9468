"""The datapath modes knit-proxyd is measured in: how the rules the daemon wrote are read back,
loaded bare, looked up and changed in each."""

from __future__ import annotations

import re
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from bench.proxy_cluster import ENDPOINTS, PORT, service_name
from bench.proxy_netns import in_netns
from cni.kernel.families import IP_FAMILIES
from cni.kernel.firewall import detect_iptables_flavour
from deploy.lab.netns import Netns
from proxyd.iptables import render as iptables_render
from proxyd.iptables.chains import ServiceChains
from proxyd.iptables.kernel import BUILTIN_CHAINS, JUMP, IptablesKernel
from proxyd.iptables.proxier import NFT_CHAINS_PER_RESTORE
from proxyd.iptables.restore import RuleSet, Script, partial_script
from proxyd.ipvs import names as ipvs_names
from proxyd.ipvs.desired import Frontend, port_state
from proxyd.model import ServicePortName, family_of
from proxyd.nftables import render as nftables_render
from proxyd.nftables.kernel import CHAIN_LINE, Nft
from proxyd.nftables.transaction import GENERATION_SUFFIXES, TableState, partial_transaction
from proxyd.port_plan import FamilyContext, PortPlan

LEGACY_HINT = "KUBE-IPTABLES-HINT"
CLUSTER_IP_RULE = re.compile(r'^-A KNIT-SERVICES .*--comment "default/([^:]+): cluster IP"')
Saved = dict[int, str]
"""The rules the daemon wrote, per family, as its mode's tool lists them."""
Load = tuple[int, str]
"""One transaction of a bare load, and its family."""


def timed(fn: Callable[[], Any]) -> float:
    began = time.monotonic()
    fn()
    return time.monotonic() - began


class Mode(ABC):
    """What differs between the modes knit-proxyd is measured in: how its rules are read
    back, written bare, looked up and changed."""

    name: str
    loader: str
    """The bare load, as the figures name it."""
    judged = False
    """The issue's goals are this mode's."""

    @abstractmethod
    def prepare(self, node: Netns) -> None:
        """Make the node look as this mode expects, before the daemon starts."""

    @abstractmethod
    def save(self, ns: Netns) -> Saved:
        """The rules the daemon wrote, in both families (its full sync writes both)."""

    @abstractmethod
    def scripts(self, saved: Saved, fresh: bool) -> list[Load]:
        """The transactions writing `saved` as a full sync of the daemon does: into a fresh
        namespace, or (not fresh) over the same rules."""

    @abstractmethod
    def write(self, family: int, text: str) -> None:
        """One transaction of the family, in the calling thread's namespace."""

    def load(self, ns: Netns, scripts: list[Load]) -> float:
        """Seconds to write the transactions into ns, from a thread inside it."""

        def write_all() -> None:
            for family, script in scripts:
                self.write(family, script)

        return in_netns(ns, lambda: timed(write_all))

    @abstractmethod
    def endpoints(self, ns: Netns, name: str, cluster_ip: str) -> str:
        """The endpoints the kernel holds for the service `name`, as listed."""

    @abstractmethod
    def change(self, ctx: FamilyContext, before: PortPlan, after: PortPlan) -> str:
        """The daemon's partial load taking one service port from `before` to `after`."""

    @abstractmethod
    def summary(self, saved: Saved) -> str:
        """How much the daemon wrote."""

    @abstractmethod
    def connection_target(self, saved: Saved, size: int) -> str:
        """The service to connect through."""

    @abstractmethod
    def dispatch(self, node: Netns, target: str) -> str:
        """How a new connection finds the target's rules."""


class Iptables(Mode):
    """One flavour of the IPv4 iptables binaries, run in namespaces."""

    name = "iptables"

    def __init__(self, flavour: str) -> None:
        self.flavour = flavour
        self.kernels = {family: IptablesKernel(family, flavour) for family in IP_FAMILIES}
        self.loader = f"{self.kernels[4].restore_binary} --noflush"

    def prepare(self, node: Netns) -> None:
        if self.flavour == "legacy":
            node.run(self.kernels[4].binary, "-t", "mangle", "-N", LEGACY_HINT)
        detected = in_netns(node, detect_iptables_flavour)
        assert detected == self.flavour, f"the node detects {detected}"

    def save(self, ns: Netns) -> Saved:
        def saved() -> Saved:
            return {f: k.save("nat") + k.save("filter") for f, k in self.kernels.items()}

        return in_netns(ns, saved)

    def scripts(self, saved: Saved, fresh: bool) -> list[Load]:
        """Per family, every chain rewritten (on nft, NFT_CHAINS_PER_RESTORE chains per
        restore, each after the chains it jumps to), the jumps from built-in chains added when
        fresh."""
        scripts = []
        for family, rules_saved in saved.items():
            chains, hooks = saved_chains(rules_saved)
            per_script = NFT_CHAINS_PER_RESTORE if self.flavour == "nft" else len(chains)
            batches = []
            for first in range(0, len(chains), per_script):
                batch = Script()
                for table, chain, rules in chains[first : first + per_script]:
                    batch.rewrite(table, chain, rules)
                batches.append(batch)
            if fresh:
                for table, chain, rule in reversed(hooks):
                    batches[-1].insert(table, chain, rule)
            scripts += [(family, batch.text()) for batch in batches]
        return scripts

    def write(self, family: int, text: str) -> None:
        self.kernels[family].restore(text)

    def endpoints(self, ns: Netns, name: str, cluster_ip: str) -> str:
        chain = ServiceChains(ServicePortName("default", name, "", "TCP")).cluster
        return ns.run(self.kernels[4].binary, "-w", "5", "-t", "nat", "-S", chain).stdout

    def change(self, ctx: FamilyContext, before: PortPlan, after: PortPlan) -> str:
        def rules(plan: PortPlan) -> RuleSet:
            rendered = iptables_render.render_service(plan, ctx)
            return RuleSet(iptables_render.render_base(ctx), {plan.port.name: rendered})

        return partial_script(rules(before), rules(after), [after.port.name]).text()

    def summary(self, saved: Saved) -> str:
        lines = [line for family in IP_FAMILIES for line in saved[family].splitlines()]
        rules = sum(1 for line in lines if line.startswith("-A "))
        chains = sum(1 for line in lines if line.startswith(":"))
        return f"{rules} rules in {chains} chains (nat + filter, IPv4 + IPv6)"

    def connection_target(self, saved: Saved, size: int) -> str:
        order = service_order(saved[4])
        print(
            f"  KNIT-SERVICES holds {len(order)} cluster IP rules, in name order: "
            f"{'yes' if order == sorted(order) else 'no'}; the last is {order[-1]}'s"
        )
        return order[-1]

    def dispatch(self, node: Netns, target: str) -> str:
        order = service_order(self.save(node)[4])
        return f"rule {order.index(target) + 1} of {len(order)}"


def saved_chains(
    saved: str,
) -> tuple[list[tuple[str, str, tuple[str, ...]]], list[tuple[str, str, str]]]:
    """iptables-save output as ([(table, chain, rules)] of the chains that are not built in,
    each after the chains it jumps to, a service's chains together as the daemon batches them;
    [(table, built-in chain, rule)])."""
    rules: dict[tuple[str, str], list[str]] = {}
    hooks = []
    table = ""
    for line in saved.splitlines():
        if line.startswith("*"):
            table = line[1:]
        elif line.startswith(":") and (name := line[1:].split(" ", 1)[0]) not in BUILTIN_CHAINS:
            rules[(table, name)] = []
        elif line.startswith("-A "):
            _, name, rule = line.split(" ", 2)
            if name in BUILTIN_CHAINS:
                hooks.append((table, name, rule))
            else:
                rules[(table, name)].append(rule)
    jumps = {
        key: [
            target
            for rule in chain
            if (m := JUMP.search(rule)) and (target := (key[0], m[1])) in rules
        ]
        for key, chain in rules.items()
    }
    jumped_to = {target for chain_jumps in jumps.values() for target in chain_jumps}
    ordered: dict[tuple[str, str], None] = {}

    def visit(key: tuple[str, str]) -> None:
        if key not in ordered:
            for target in jumps[key]:
                visit(target)
            ordered[key] = None

    for key in sorted(rules, key=lambda key: key in jumped_to):  # from the chains none jumps to
        visit(key)
    return [(table, name, tuple(rules[(table, name)])) for table, name in ordered], hooks


class Nftables(Mode):
    """The daemon's table `ip knit`, read and loaded with nft in namespaces."""

    name = "nftables"
    loader = "nft -f"
    judged = True

    def __init__(self) -> None:
        self.kernels = {family: Nft(family) for family in IP_FAMILIES}
        self.saved_generation = 0
        """The generation of maps the last listing saved holds (the anchor's, once loaded)."""

    def prepare(self, node: Netns) -> None:
        """Nothing: the mode does not depend on the node's iptables."""

    def save(self, ns: Netns) -> Saved:
        saved = {
            family: ns.run("nft", "list", "table", *kernel.table.split(), timeout=600).stdout
            for family, kernel in self.kernels.items()
        }
        # Between full syncs the table holds one generation (both only after a refused one,
        # which fails the bench anyway).
        newer = f"map {nftables_render.SERVICE_IPS}{GENERATION_SUFFIXES[1]} {{"
        self.saved_generation = 1 if newer in saved[4] else 0
        return saved

    def scripts(self, saved: Saved, fresh: bool) -> list[Load]:
        """Both tables in one transaction (nft writes any family's)."""
        tables = "".join(saved.values())
        deleted = "".join(f"delete table {kernel.table}\n" for kernel in self.kernels.values())
        return [(4, tables if fresh else deleted + tables)]

    def write(self, family: int, text: str) -> None:
        """A bare `nft -f` process (the daemon runs libnftables in its own process)."""
        _load(["nft", "-f", "-"], text)

    def endpoints(self, ns: Netns, name: str, cluster_ip: str) -> str:
        """The elements of the endpoint map keyed by the service's cluster IP, in whichever
        generation the table holds (without the map's name, which tells the generation)."""
        keys = ", ".join(f"{cluster_ip} . {PORT} . {index}" for index in range(ENDPOINTS))
        endpoint_map = nftables_render.IPS.endpoint_map(local=False, proto="tcp")
        table = self.kernels[4].table.split()
        maps = ns.run("nft", "--terse", "list", "maps", table[0]).stdout
        for suffix in GENERATION_SUFFIXES:
            if f"map {endpoint_map}{suffix} {{" not in maps:
                continue
            got = ns.run(
                "nft",
                "get",
                "element",
                *table,
                f"{endpoint_map}{suffix}",
                f"{{ {keys} }}",
                check=False,
            )
            if got.returncode == 0:
                return got.stdout.split("elements = ", 1)[-1]
        raise RuntimeError(f"no endpoint map holds {name}'s endpoints in {ns.name}")

    def change(self, ctx: FamilyContext, before: PortPlan, after: PortPlan) -> str:
        """The change as the daemon writes it, in the generation of the anchor's table."""
        name = after.port.name
        port_ctx = nftables_render.PortContext.of(ctx)
        table = TableState(nftables_render.render_base(ctx), generation=self.saved_generation)
        before_objects = nftables_render.render_service(before, port_ctx)
        partial_transaction(ctx.family, table, {name: before_objects})  # as the daemon wrote it
        return partial_transaction(
            ctx.family, table, {name: nftables_render.render_service(after, port_ctx)}
        )

    def summary(self, saved: Saved) -> str:
        return ", ".join(
            f"{len(CHAIN_LINE.findall(saved[family]))} chains in table {kernel.table}"
            for family, kernel in self.kernels.items()
        )

    def connection_target(self, saved: Saved, size: int) -> str:
        return service_name(size - 1)

    def dispatch(self, node: Netns, target: str) -> str:
        return "a verdict-map lookup, then an endpoint-map lookup"


SECTION = "#section "
"""Starts each tool's part of the IPVS mode's saved text and loads (Ipvs.write)."""
SCHEDULER = "rr"
"""knit-proxyd's and kube-proxy's default IPVS scheduler."""
DUMMY_ADDRESS = re.compile(r"\binet6? (\S+)")


def _sections(text: str) -> dict[str, list[str]]:
    """A saved text or load of the IPVS mode, split by tool."""
    parts: dict[str, list[str]] = {}
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith(SECTION):
            lines = parts.setdefault(line.removeprefix(SECTION), [])
        elif line:
            lines.append(line)
    return parts


def _joined(parts: dict[str, list[str]]) -> str:
    return "".join(
        f"{SECTION}{tool}\n" + "".join(f"{line}\n" for line in lines)
        for tool, lines in parts.items()
        if lines
    )


def _virtual(frontend: Frontend) -> str:
    """ipvsadm's service option for a TCP frontend (the bench's services are TCP)."""
    address = f"[{frontend.address}]" if ":" in frontend.address else frontend.address
    return f"-t {address}:{frontend.port}"


class Ipvs(Mode):
    """The daemon's IPVS state, each part read and loaded bare by the tool made for it: its
    virtual servers (ipvsadm), its dummy link's addresses (ip), its ipsets (ipset) and its
    iptables rules (iptables-save and -restore). The saved text and each load hold the
    tools' parts one after another, in the order a fresh node needs them."""

    name = "ipvs"
    loader = "ipvsadm -R + ip -batch + ipset restore + iptables-restore"

    def __init__(self) -> None:
        self.kernels: dict[int, IptablesKernel] = {}

    def prepare(self, node: Netns) -> None:
        """The iptables flavour the node detects, as the daemon will."""
        flavour = in_netns(node, detect_iptables_flavour)
        self.kernels = {family: IptablesKernel(family, flavour) for family in IP_FAMILIES}

    def save(self, ns: Netns) -> Saved:
        servers = ns.run("ipvsadm", "-S", "-n", timeout=600).stdout.splitlines()
        dummy = ns.run("ip", "-o", "address", "show", "dev", ipvs_names.DUMMY).stdout
        addresses = [m[1] for m in DUMMY_ADDRESS.finditer(dummy)]
        sets = ns.run("ipset", "save").stdout.splitlines()

        def rules() -> dict[int, str]:
            return {f: k.save("nat") + k.save("filter") for f, k in self.kernels.items()}

        iptables = in_netns(ns, rules)
        saved = {}
        for family in IP_FAMILIES:
            prefix = ipvs_names.set_name("", family)
            parts = {
                "ip": [
                    f"address add {a} dev {ipvs_names.DUMMY}"
                    for a in addresses
                    if family_of(a) == family
                ],
                "ipset": [line for line in sets if line.split(" ", 2)[1].startswith(prefix)],
                "ipvsadm": [
                    line
                    for line in servers
                    if family_of(line.split(" ", 3)[2].rsplit(":", 1)[0]) == family
                ],
                "iptables": iptables[family].splitlines(),
            }
            saved[family] = _joined(parts)
        return saved

    def scripts(self, saved: Saved, fresh: bool) -> list[Load]:
        """Per family, the whole state: into a fresh namespace (the dummy link made first),
        or over the same state (every virtual and real server edited to what it is, every
        address replaced, every set member added again, every chain rewritten)."""
        loads = []
        for family, text in saved.items():
            parts = _sections(text)
            chains, hooks = saved_chains("\n".join(parts.pop("iptables", [])))
            script = Script()
            for table, chain, rules in chains:
                script.rewrite(table, chain, rules)
            if fresh:
                for table, chain, rule in reversed(hooks):
                    script.insert(table, chain, rule)
                if family == 4:
                    parts["ip"].insert(0, f"link add {ipvs_names.DUMMY} type dummy")
            else:
                parts["ip"] = [
                    line.replace("address add", "address replace", 1)
                    for line in parts.get("ip", [])
                ]
                parts["ipvsadm"] = [
                    line.replace("-A ", "-E ", 1).replace("-a ", "-e ", 1)
                    for line in parts.get("ipvsadm", [])
                ]
            parts["iptables"] = script.text().splitlines()
            loads.append((family, _joined(parts)))
        return loads

    def write(self, family: int, text: str) -> None:
        for tool, lines in _sections(text).items():
            body = "".join(f"{line}\n" for line in lines)
            if tool == "iptables":
                self.kernels[family].restore(body)
                continue
            argv = {
                "ip": ["ip", "-batch", "-"],
                "ipset": ["ipset", "restore", "-exist"],
                "ipvsadm": ["ipvsadm", "-R"],
            }[tool]
            _load(argv, body)

    def endpoints(self, ns: Netns, name: str, cluster_ip: str) -> str:
        """The real servers of the service's virtual server, with their weights."""
        frontend = Frontend(cluster_ip, "TCP", PORT)
        listing = ns.run("ipvsadm", "-L", "-n", *_virtual(frontend).split()).stdout
        servers = [line.split() for line in listing.splitlines() if line.strip().startswith("->")]
        return " ".join(sorted(f"{f[1]} w{f[3]}" for f in servers if f[1] != "RemoteAddress:Port"))

    def change(self, ctx: FamilyContext, before: PortPlan, after: PortPlan) -> str:
        """The real servers the daemon's own desired state adds and removes (an idle real
        server goes at once, as the daemon deletes it)."""
        old = {
            s.frontend: s.real_servers
            for s in port_state(before, ctx, SCHEDULER, ()).virtual_servers
        }
        lines = []
        for server in port_state(after, ctx, SCHEDULER, ()).virtual_servers:
            virtual, previous = _virtual(server.frontend), old.get(server.frontend, frozenset())
            lines += [
                f"-a {virtual} -r {r.ip}:{r.port} -m -w 1"
                for r in sorted(server.real_servers - previous)
            ]
            lines += [
                f"-d {virtual} -r {r.ip}:{r.port}" for r in sorted(previous - server.real_servers)
            ]
        return _joined({"ipvsadm": lines})

    def summary(self, saved: Saved) -> str:
        parts = [_sections(text) for text in saved.values()]

        def count(tool: str, prefix: str) -> int:
            return sum(1 for p in parts for line in p.get(tool, []) if line.startswith(prefix))

        return (
            f"{count('ipvsadm', '-A ')} virtual servers with {count('ipvsadm', '-a ')} real "
            f"servers, {count('ip', 'address ')} dummy addresses, {count('ipset', 'add ')} set "
            f"members, {count('iptables', '-A ')} iptables rules (IPv4 + IPv6)"
        )

    def connection_target(self, saved: Saved, size: int) -> str:
        return service_name(size - 1)

    def dispatch(self, node: Netns, target: str) -> str:
        return "an IPVS virtual-server lookup"


def service_order(saved: str) -> list[str]:
    """Service names in the order of their cluster IP rules in KNIT-SERVICES."""
    return [m.group(1) for line in saved.splitlines() if (m := CLUSTER_IP_RULE.match(line))]


def _load(argv: list[str], text: str) -> None:
    """A bare load of `text` by a tool reading it on its standard input; RuntimeError naming
    what the tool said and the start of what it refused."""
    done = subprocess.run(argv, input=text, text=True, capture_output=True)
    if done.returncode:
        raise RuntimeError(f"a bare {' '.join(argv)} failed: {done.stderr.strip()}\n{text[:2000]}")
