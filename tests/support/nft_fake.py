"""A fake nftables ruleset that applies transactions as knit writes them, in nft's text.

Only the syntax knit's renderers emit is understood; anything else raises NftError, so a
renderer that starts writing something new fails here loudly instead of being traced wrong.
A transaction is atomic, as nft's batches are: one that fails leaves the ruleset as it was.
Besides the syntax, the fake keeps the kernel's rules knit's transactions are ordered by:
what a rule or an element names must exist, a chain or set still named cannot be deleted
nor a chain holding rules, a range needs an interval set, interval elements must not overlap,
and a map key cannot be added again with another value.

The rules are parsed into small data objects (selectors, matches, lookups, statements);
tests/support/nft_trace.py evaluates them for a packet.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

Interval = tuple[int, int]
"""A literal as the closed range of integers it stands for (one value: first == last)."""
Key = tuple[Interval, ...]
"""A set element or a literal: one interval per component of a concatenation."""


class NftError(Exception):
    """What nft would refuse, or syntax the fake does not know."""


# ------------------------------------------------------------------ datatypes


@dataclass(frozen=True)
class Datatype:
    name: str
    parse: Callable[[str], Interval]
    bitmask: bool = False
    """A literal matches when it shares a bit with the value (ct state, ct status)."""


def _address_parser(version: int) -> Callable[[str], Interval]:
    def parse(text: str) -> Interval:
        try:
            if "/" in text:
                network = ipaddress.ip_network(text)
                first, last = network.network_address, network.broadcast_address
            elif "-" in text:
                low, high = text.split("-")
                first, last = ipaddress.ip_address(low), ipaddress.ip_address(high)
            else:
                first = last = ipaddress.ip_address(text)
        except ValueError as error:
            raise NftError(f"not an address: {text!r}") from error
        if first.version != version or last.version != version:
            raise NftError(f"not an IPv{version} address: {text!r}")
        return int(first), int(last)

    return parse


def _number_parser(limit: int) -> Callable[[str], Interval]:
    def parse(text: str) -> Interval:
        low, _, high = text.partition("-")
        try:
            first, last = int(low, 0), int(high or low, 0)
        except ValueError as error:
            raise NftError(f"not a number: {text!r}") from error
        if not 0 <= first <= last <= limit:
            raise NftError(f"out of range: {text!r}")
        return first, last

    return parse


def _named_parser(names: dict[str, int]) -> Callable[[str], Interval]:
    def parse(text: str) -> Interval:
        if text not in names:
            raise NftError(f"unknown value {text!r}, expected one of {sorted(names)}")
        return names[text], names[text]

    return parse


PROTOCOL_NUMBERS = {"tcp": 6, "udp": 17, "sctp": 132}
CT_STATES = {"invalid": 1, "established": 2, "related": 4, "new": 8, "untracked": 64}
CT_STATUS_DNAT = 0x20
ADDRESS_TYPE_LOCAL = 2

IPV4 = Datatype("ipv4_addr", _address_parser(4))
IPV6 = Datatype("ipv6_addr", _address_parser(6))
PROTOCOL = Datatype("inet_proto", _named_parser(PROTOCOL_NUMBERS))
SERVICE = Datatype("inet_service", _number_parser(0xFFFF))
INTEGER = Datatype("integer", _number_parser(0xFFFFFFFF))
MARK = Datatype("mark", _number_parser(0xFFFFFFFF))
CT_STATE = Datatype("ct_state", _named_parser(CT_STATES), bitmask=True)
CT_STATUS = Datatype("ct_status", _named_parser({"snat": 0x10, "dnat": CT_STATUS_DNAT}), True)
ADDRESS_TYPE = Datatype("fib_addrtype", _named_parser({"unicast": 1, "local": ADDRESS_TYPE_LOCAL}))
VERDICT_TYPE = Datatype("verdict", _named_parser({}))
TYPES_BY_NAME = {t.name: t for t in (IPV4, IPV6, PROTOCOL, SERVICE, INTEGER, MARK, VERDICT_TYPE)}


# ------------------------------------------------------------------ rule objects


@dataclass(frozen=True)
class Selector:
    """What a rule reads from a packet: `ip saddr`, `th dport`, `numgen random mod 2`..."""

    text: str
    datatype: Datatype
    family: int | None = None
    """The l3 family it reads (ip: 4, ip6: 6), None when any."""
    protocol: int | None = None
    """The transport protocol it needs (`tcp dport`), None when any."""
    modulus: int = 0
    """numgen's: the value is one of 0..modulus-1."""


@dataclass(frozen=True)
class Verdict:
    kind: str
    """accept, drop, reject, jump, goto, return; `continue` for a rule that matched without
    a verdict, `break` for one that stopped matching (a lookup without an element)."""
    chain: str | None = None

    def __str__(self) -> str:
        return f"{self.kind} {self.chain}" if self.chain else self.kind


CONTINUE = Verdict("continue")
BREAK = Verdict("break")


@dataclass(frozen=True)
class Match:
    """`selectors [& mask] [!=] literal-or-anonymous-set`."""

    selectors: tuple[Selector, ...]
    keys: tuple[Key, ...]
    negated: bool = False
    mask: int | None = None


@dataclass(frozen=True)
class Lookup:
    """`selectors [!=] @set`."""

    selectors: tuple[Selector, ...]
    set_name: str
    negated: bool = False


@dataclass(frozen=True)
class VerdictMap:
    """`selectors vmap @map`."""

    selectors: tuple[Selector, ...]
    map_name: str


@dataclass(frozen=True)
class Counter:
    name: str | None


@dataclass(frozen=True)
class Limit:
    name: str


@dataclass(frozen=True)
class Log:
    prefix: str
    group: int


@dataclass(frozen=True)
class SetMark:
    """`meta mark set [meta mark OP] value`; no operator: the mark becomes the value."""

    operator: str | None
    operand: int


@dataclass(frozen=True)
class Update:
    """`update @set { selectors }`: the packet's key joins a dynamic set."""

    set_name: str
    selectors: tuple[Selector, ...]


@dataclass(frozen=True)
class DNat:
    address: str
    port: int


@dataclass(frozen=True)
class DNatMap:
    """`dnat to selectors map @map`: address . port looked up by the packet's key."""

    selectors: tuple[Selector, ...]
    map_name: str


@dataclass(frozen=True)
class Masquerade:
    pass


@dataclass(frozen=True)
class Terminal:
    """A verdict statement: accept, drop, reject, return, jump X, goto X."""

    verdict: Verdict


Item = (
    Match
    | Lookup
    | VerdictMap
    | Counter
    | Limit
    | Log
    | SetMark
    | Update
    | DNat
    | DNatMap
    | Masquerade
    | Terminal
)


@dataclass(frozen=True)
class Rule:
    text: str
    items: tuple[Item, ...]

    def sets(self) -> set[str]:
        named: set[str] = set()
        for item in self.items:
            if isinstance(item, Lookup | Update):
                named.add(item.set_name)
            elif isinstance(item, VerdictMap | DNatMap):
                named.add(item.map_name)
        return named

    def chains(self) -> set[str]:
        return {
            item.verdict.chain
            for item in self.items
            if isinstance(item, Terminal) and item.verdict.chain is not None
        }

    def objects(self) -> set[str]:
        """Named counters and limits."""
        named = {item.name for item in self.items if isinstance(item, Limit)}
        return named | {item.name for item in self.items if isinstance(item, Counter) and item.name}


# ------------------------------------------------------------------ ruleset objects

PRIORITIES = {"raw": -300, "mangle": -150, "dstnat": -100, "filter": 0, "security": 50}
PRIORITIES["srcnat"] = 100
HOOKS = ("prerouting", "input", "forward", "output", "postrouting")


@dataclass(frozen=True)
class Hook:
    type: str
    hook: str
    priority: int
    policy: str


@dataclass
class Chain:
    name: str
    hook: Hook | None = None
    comment: str = ""
    rules: list[Rule] = field(default_factory=list)


MapValue = Verdict | tuple[int, ...] | None
"""A verdict map's value, a data map's (one integer per component), or None in a set."""


@dataclass
class NamedSet:
    name: str
    key: tuple[Datatype, ...]
    data: tuple[Datatype, ...]
    """Empty for a set; (VERDICT_TYPE,) for a verdict map."""
    flags: frozenset[str]
    elements: dict[Key, MapValue] = field(default_factory=dict)

    @property
    def is_map(self) -> bool:
        return bool(self.data)

    def get(self, key: tuple[int, ...]) -> tuple[bool, MapValue]:
        """(whether an element holds the key, its value)."""
        for element, value in self.elements.items():
            if all(first <= part <= last for part, (first, last) in zip(key, element, strict=True)):
                return True, value
        return False, None


@dataclass
class Table:
    family: int
    name: str
    comment: str = ""
    chains: dict[str, Chain] = field(default_factory=dict)
    sets: dict[str, NamedSet] = field(default_factory=dict)
    counters: set[str] = field(default_factory=set)
    limits: set[str] = field(default_factory=set)

    def copy(self) -> Table:
        chains = {name: replace(c, rules=list(c.rules)) for name, c in self.chains.items()}
        sets = {name: replace(s, elements=dict(s.elements)) for name, s in self.sets.items()}
        return replace(
            self, chains=chains, sets=sets, counters=set(self.counters), limits=set(self.limits)
        )

    def chain(self, name: str) -> Chain:
        if name not in self.chains:
            raise NftError(f"no chain {name} in table {self.name}")
        return self.chains[name]

    def named_set(self, name: str) -> NamedSet:
        if name not in self.sets:
            raise NftError(f"no set or map {name} in table {self.name}")
        return self.sets[name]

    def rules(self) -> Iterator[Rule]:
        for chain in self.chains.values():
            yield from chain.rules


# ------------------------------------------------------------------ tokens

TOKEN = re.compile(r'"[^"]*"|[{},;]|[^\s{},;"]+')


class Tokens:
    """A line's words, with `{ } , ;` and quoted strings apart, read front to back."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.words = TOKEN.findall(text)
        self.position = 0

    def peek(self, ahead: int = 0) -> str | None:
        index = self.position + ahead
        return self.words[index] if index < len(self.words) else None

    def take(self) -> str:
        word = self.peek()
        if word is None:
            raise NftError(f"unexpected end of {self.text!r}")
        self.position += 1
        return word

    def expect(self, *words: str) -> None:
        for word in words:
            found = self.take()
            if found != word:
                raise NftError(f"expected {word!r}, found {found!r} in {self.text!r}")

    def accept(self, word: str) -> bool:
        if self.peek() == word:
            self.position += 1
            return True
        return False

    def done(self) -> bool:
        return self.position == len(self.words)

    def quoted(self) -> str:
        word = self.take()
        if not (len(word) >= 2 and word[0] == word[-1] == '"'):
            raise NftError(f"expected a quoted string, found {word!r} in {self.text!r}")
        return word[1:-1]

    def number(self) -> int:
        word = self.take()
        if not word.isdigit():
            raise NftError(f"expected a number, found {word!r} in {self.text!r}")
        return int(word)


# ------------------------------------------------------------------ expressions

SELECTOR_STARTS = ("ip", "ip6", "meta", "th", "tcp", "udp", "sctp", "ct", "fib", "numgen")


def _selector(tokens: Tokens) -> Selector:
    first = tokens.take()
    if first in ("ip", "ip6"):
        field_name = tokens.take()
        if field_name not in ("saddr", "daddr"):
            raise NftError(f"unknown selector {first} {field_name}")
        family = 4 if first == "ip" else 6
        return Selector(f"{first} {field_name}", IPV4 if family == 4 else IPV6, family=family)
    if first == "meta":
        field_name = tokens.take()
        if field_name == "l4proto":
            return Selector("meta l4proto", PROTOCOL)
        if field_name == "mark":
            return Selector("meta mark", MARK)
        raise NftError(f"unknown selector meta {field_name}")
    if first in ("th", "tcp", "udp", "sctp"):
        tokens.expect("dport")
        return Selector(f"{first} dport", SERVICE, protocol=PROTOCOL_NUMBERS.get(first))
    if first == "ct":
        field_name = tokens.take()
        if field_name == "state":
            return Selector("ct state", CT_STATE)
        if field_name == "status":
            return Selector("ct status", CT_STATUS)
        if field_name == "mark":
            return Selector("ct mark", MARK)
        raise NftError(f"unknown selector ct {field_name}")
    if first == "fib":
        address = tokens.take()
        if address not in ("saddr", "daddr"):
            raise NftError(f"unknown selector fib {address}")
        tokens.expect("type")
        return Selector(f"fib {address} type", ADDRESS_TYPE)
    if first == "numgen":
        tokens.expect("random", "mod")
        modulus = tokens.number()
        return Selector(f"numgen random mod {modulus}", INTEGER, modulus=modulus)
    raise NftError(f"unknown expression {first!r} in {tokens.text!r}")


def _selectors(tokens: Tokens, family: int) -> tuple[Selector, ...]:
    """A concatenation `a . b . c`; an l3 selector of the other family is refused."""
    selectors = [_selector(tokens)]
    while tokens.accept("."):
        selectors.append(_selector(tokens))
    for selector in selectors:
        if selector.family not in (None, family):
            raise NftError(f"{selector.text} in an IPv{family} table: {tokens.text!r}")
    return tuple(selectors)


def _key(tokens: Tokens, types: tuple[Datatype, ...]) -> Key:
    """`a . b . c`, each component read as its type."""
    parts: list[Interval] = []
    for index, datatype in enumerate(types):
        if index:
            tokens.expect(".")
        parts.append(datatype.parse(tokens.take()))
    return tuple(parts)


def _literal(tokens: Tokens, types: tuple[Datatype, ...]) -> tuple[Key, ...]:
    """A literal, or an anonymous set of them; a bitmask's flags, as `new,established`."""
    if tokens.accept("{"):
        keys = [_key(tokens, types)]
        while tokens.accept(","):
            keys.append(_key(tokens, types))
        tokens.expect("}")
        return tuple(keys)
    key = _key(tokens, types)
    if len(types) == 1 and types[0].bitmask:
        bits = key[0][0]
        while tokens.accept(","):
            bits |= types[0].parse(tokens.take())[0]
        key = ((bits, bits),)
    return (key,)


def _set_reference(tokens: Tokens) -> str:
    word = tokens.take()
    if not word.startswith("@"):
        raise NftError(f"expected @set, found {word!r} in {tokens.text!r}")
    return word[1:]


def _verdict(tokens: Tokens) -> Verdict:
    word = tokens.take()
    if word in ("jump", "goto"):
        return Verdict(word, tokens.take())
    if word in ("accept", "drop", "return"):
        return Verdict(word)
    raise NftError(f"not a verdict: {word!r} in {tokens.text!r}")


def _relation(tokens: Tokens, selectors: tuple[Selector, ...]) -> Item:
    """What follows a selector in a match: a lookup, a verdict map or a comparison."""
    if tokens.accept("vmap"):
        return VerdictMap(selectors, _set_reference(tokens))
    negated = tokens.accept("!=")
    following = tokens.peek()
    if following is not None and following.startswith("@"):
        return Lookup(selectors, _set_reference(tokens), negated)
    mask = None
    if not negated and tokens.accept("&"):
        mask = MARK.parse(tokens.take())[0]
        if not tokens.accept("=="):
            tokens.expect("!=")
            negated = True
    elif not negated:
        tokens.accept("==")
    types = tuple(selector.datatype for selector in selectors)
    return Match(selectors, _literal(tokens, types), negated, mask)


def _dnat(tokens: Tokens, family: int) -> Item:
    tokens.expect("to")
    if tokens.peek() in SELECTOR_STARTS:
        selectors = _selectors(tokens, family)
        tokens.expect("map")
        return DNatMap(selectors, _set_reference(tokens))
    target = tokens.take()
    address, separator, port = target.rpartition(":")
    if not separator:
        raise NftError(f"dnat without a port: {tokens.text!r}")
    address = address.removeprefix("[").removesuffix("]")
    (IPV4 if family == 4 else IPV6).parse(address)
    return DNat(address, SERVICE.parse(port)[0])


def _statement(tokens: Tokens, family: int) -> Item | None:
    """The statement at the front, or None when a match comes next."""
    word = tokens.peek()
    if word in ("accept", "drop", "return", "jump", "goto"):
        return Terminal(_verdict(tokens))
    if tokens.accept("reject"):
        return Terminal(Verdict("reject"))
    if tokens.accept("counter"):
        return Counter(tokens.take() if tokens.accept("name") else None)
    if tokens.accept("limit"):
        tokens.expect("name")
        return Limit(tokens.take())
    if tokens.accept("log"):
        tokens.expect("prefix")
        prefix = tokens.quoted()
        tokens.expect("group")
        return Log(prefix, tokens.number())
    if tokens.accept("masquerade"):
        tokens.accept("fully-random")
        return Masquerade()
    if tokens.accept("dnat"):
        return _dnat(tokens, family)
    if tokens.accept("update"):
        set_name = _set_reference(tokens)
        tokens.expect("{")
        selectors = _selectors(tokens, family)
        tokens.expect("}")
        return Update(set_name, selectors)
    if (word, tokens.peek(1), tokens.peek(2)) == ("meta", "mark", "set"):
        tokens.expect("meta", "mark", "set")
        if tokens.peek() == "meta":
            tokens.expect("meta", "mark")
            operator = tokens.take()
            if operator not in ("|", "^", "&"):
                raise NftError(f"unknown mark operator {operator!r} in {tokens.text!r}")
            return SetMark(operator, MARK.parse(tokens.take())[0])
        return SetMark(None, MARK.parse(tokens.take())[0])
    return None


def parse_rule(text: str, family: int) -> Rule:
    tokens = Tokens(text)
    items: list[Item] = []
    while not tokens.done():
        statement = _statement(tokens, family)
        items.append(statement or _relation(tokens, _selectors(tokens, family)))
    if not items:
        raise NftError("an empty rule")
    return Rule(text, tuple(items))


# ------------------------------------------------------------------ declarations


def _clauses(tokens: Tokens) -> Iterator[Tokens]:
    """The `;`-separated clauses of a `{ ... }` block (nothing when there is no block)."""
    if tokens.done():
        return
    tokens.expect("{")
    while not tokens.accept("}"):
        start = tokens.position
        while tokens.peek() not in (";", "}"):
            tokens.take()
        clause = Tokens(" ".join(tokens.words[start : tokens.position]))
        tokens.accept(";")
        if not clause.done():
            yield clause
    if not tokens.done():
        raise NftError(f"text after the block: {tokens.text!r}")


def _finished(clause: Tokens) -> None:
    if not clause.done():
        raise NftError(f"unknown clause {clause.text!r}")


def _priority(clause: Tokens) -> int:
    word = clause.take()
    base = PRIORITIES[word] if word in PRIORITIES else _signed(word)
    if clause.peek() in ("+", "-"):
        sign = -1 if clause.take() == "-" else 1
        base += sign * clause.number()
    return base


def _signed(word: str) -> int:
    if not re.fullmatch(r"-?\d+", word):
        raise NftError(f"unknown priority {word!r}")
    return int(word)


def _chain_declaration(name: str, tokens: Tokens) -> Chain:
    chain = Chain(name)
    kind = hook = policy = ""
    priority: int | None = None
    for clause in _clauses(tokens):
        word = clause.take()
        if word == "type":
            kind = clause.take()
            clause.expect("hook")
            hook = clause.take()
            clause.expect("priority")
            priority = _priority(clause)
        elif word == "policy":
            policy = clause.take()
        elif word == "comment":
            chain.comment = clause.quoted()
        else:
            raise NftError(f"unknown chain clause {clause.text!r}")
        _finished(clause)
    if kind:
        if kind not in ("filter", "nat") or hook not in HOOKS or priority is None:
            raise NftError(f"unknown base chain {kind} {hook} in {tokens.text!r}")
        if policy not in ("accept", "drop"):
            raise NftError(f"base chain {name} without a policy accept or drop")
        chain.hook = Hook(kind, hook, priority, policy)
    elif policy:
        raise NftError(f"a policy without a hook on chain {name}")
    return chain


def _types(clause: Tokens, family: int, typeof: bool) -> tuple[Datatype, ...]:
    if typeof:
        return tuple(selector.datatype for selector in _selectors(clause, family))
    names = [clause.take()]
    while clause.accept("."):
        names.append(clause.take())
    unknown = [name for name in names if name not in TYPES_BY_NAME]
    if unknown:
        raise NftError(f"unknown set type {unknown} in {clause.text!r}")
    return tuple(TYPES_BY_NAME[name] for name in names)


def _set_declaration(name: str, tokens: Tokens, family: int, is_map: bool) -> NamedSet:
    key: tuple[Datatype, ...] = ()
    data: tuple[Datatype, ...] = ()
    flags: set[str] = set()
    for clause in _clauses(tokens):
        word = clause.take()
        if word in ("type", "typeof"):
            key = _types(clause, family, word == "typeof")
            if clause.accept(":"):
                data = _types(clause, family, word == "typeof")
        elif word == "flags":
            flags.add(clause.take())
            while clause.accept(","):
                flags.add(clause.take())
        elif word == "timeout":
            _number_parser(2**32)(clause.take().removesuffix("s"))
        else:
            raise NftError(f"unknown set clause {clause.text!r}")
        _finished(clause)
    unknown_flags = flags - {"interval", "dynamic", "timeout"}
    if unknown_flags or not key or is_map != bool(data):
        raise NftError(f"a set or map declaration nft would refuse: {tokens.text!r}")
    if VERDICT_TYPE in key or (VERDICT_TYPE in data and len(data) > 1):
        raise NftError(f"a verdict out of place in {tokens.text!r}")
    return NamedSet(name, key, data, frozenset(flags))


def _elements(
    tokens: Tokens, target: NamedSet, with_values: bool
) -> Iterator[tuple[Key, MapValue]]:
    tokens.expect("{")
    while True:
        key = _key(tokens, target.key)
        value: MapValue = None
        if with_values and target.is_map:
            tokens.expect(":")
            if target.data == (VERDICT_TYPE,):
                value = _verdict(tokens)
            else:
                value = tuple(first for first, _ in _key(tokens, target.data))
        yield key, value
        if not tokens.accept(","):
            break
    tokens.expect("}")
    if not tokens.done():
        raise NftError(f"text after the elements: {tokens.text!r}")


# ------------------------------------------------------------------ the ruleset

FAMILIES = {"ip": 4, "ip6": 6}
TableKey = tuple[int, str]


class Ruleset:
    """Tables by (family, name), changed only by whole transactions."""

    def __init__(self) -> None:
        self.tables: dict[TableKey, Table] = {}

    def apply(self, text: str) -> None:
        """Apply one transaction; on any error raise NftError and change nothing."""
        working = {key: table.copy() for key, table in self.tables.items()}
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                _command(working, Tokens(line))
            except NftError as error:
                raise NftError(f"line {number}: {line}\n  {error}") from error
        self.tables = working

    def base_chains(self, family: int, hook: str) -> list[tuple[Table, Chain]]:
        """The family's chains on the hook, in the order the kernel calls them."""
        hooked = [
            (table, chain)
            for (table_family, _), table in self.tables.items()
            if table_family == family
            for chain in table.chains.values()
            if chain.hook is not None and chain.hook.hook == hook
        ]
        return sorted(hooked, key=lambda pair: pair[1].hook.priority if pair[1].hook else 0)


def _command(tables: dict[TableKey, Table], tokens: Tokens) -> None:
    verb, thing, family_word = tokens.take(), tokens.take(), tokens.take()
    if verb not in ("add", "delete", "flush") or family_word not in FAMILIES:
        raise NftError(f"unknown command {tokens.text!r}")
    family = FAMILIES[family_word]
    key = (family, tokens.take())
    if thing == "table":
        _table_command(tables, key, verb, tokens)
        return
    if key not in tables:
        raise NftError(f"no table {family_word} {key[1]}")
    table = tables[key]
    name = tokens.take()
    commands: dict[tuple[str, str], Callable[[], None]] = {
        ("add", "chain"): lambda: _add_chain(table, name, tokens),
        ("flush", "chain"): lambda: table.chain(name).rules.clear(),
        ("delete", "chain"): lambda: _delete_chain(table, name),
        ("add", "rule"): lambda: _add_rule(table, name, tokens.text, tokens),
        ("add", "set"): lambda: _add_set(table, name, tokens, is_map=False),
        ("add", "map"): lambda: _add_set(table, name, tokens, is_map=True),
        ("flush", "set"): lambda: _kind(table.named_set(name), False).elements.clear(),
        ("flush", "map"): lambda: _kind(table.named_set(name), True).elements.clear(),
        ("delete", "set"): lambda: _delete_set(table, name, is_map=False),
        ("delete", "map"): lambda: _delete_set(table, name, is_map=True),
        ("add", "element"): lambda: _add_elements(table, table.named_set(name), tokens),
        ("delete", "element"): lambda: _delete_elements(table.named_set(name), tokens),
        ("add", "counter"): lambda: _add_counter(table.counters, name, tokens),
        ("delete", "counter"): lambda: _delete_object(table, table.counters, name),
        ("add", "limit"): lambda: _add_limit(table, name, tokens),
        ("delete", "limit"): lambda: _delete_object(table, table.limits, name),
    }
    if (verb, thing) not in commands:
        raise NftError(f"unknown command {verb} {thing}")
    commands[(verb, thing)]()
    if thing != "rule" and not tokens.done():
        raise NftError(f"text after the command: {tokens.text!r}")


def _table_command(tables: dict[TableKey, Table], key: TableKey, verb: str, tokens: Tokens) -> None:
    if verb == "delete":
        if key not in tables:
            raise NftError(f"no table {key[1]} to delete")
        del tables[key]
        return
    if verb != "add":
        raise NftError(f"unknown command {tokens.text!r}")
    table = tables.setdefault(key, Table(*key))
    for clause in _clauses(tokens):
        clause.expect("comment")
        table.comment = clause.quoted()
        _finished(clause)


def _add_chain(table: Table, name: str, tokens: Tokens) -> None:
    declared = _chain_declaration(name, tokens)
    existing = table.chains.get(name)
    if existing is None:
        table.chains[name] = declared
    elif declared.hook is not None and declared.hook != existing.hook:
        raise NftError(f"chain {name} exists with another hook")


def _delete_chain(table: Table, name: str) -> None:
    chain = table.chain(name)
    if chain.rules:
        raise NftError(f"chain {name} still holds rules")
    if any(name in rule.chains() for rule in table.rules()) or any(
        value == Verdict("jump", name) or value == Verdict("goto", name)
        for named in table.sets.values()
        for value in named.elements.values()
    ):
        raise NftError(f"chain {name} is still jumped to")
    del table.chains[name]


def _add_rule(table: Table, chain_name: str, line: str, tokens: Tokens) -> None:
    chain = table.chain(chain_name)
    rule = parse_rule(" ".join(tokens.words[tokens.position :]), table.family)
    for target in rule.chains():
        if table.chain(target).hook is not None:
            raise NftError(f"a jump to base chain {target}: {line!r}")
    for item in rule.items:
        if isinstance(item, Lookup | VerdictMap | DNatMap | Update):
            _check_reference(table, item)
    missing = rule.objects() - table.counters - table.limits
    if missing:
        raise NftError(f"no counter or limit {sorted(missing)}: {line!r}")
    chain.rules.append(rule)


def _check_reference(table: Table, item: Lookup | VerdictMap | DNatMap | Update) -> None:
    name = item.map_name if isinstance(item, VerdictMap | DNatMap) else item.set_name
    target = table.named_set(name)
    wanted_kind = {VerdictMap: "verdict map", DNatMap: "data map"}.get(type(item), "set")
    kind = (
        "set"
        if not target.is_map
        else ("verdict map" if target.data == (VERDICT_TYPE,) else "data map")
    )
    if kind != wanted_kind:
        raise NftError(f"@{name} is a {kind}, used as a {wanted_kind}")
    types = tuple(selector.datatype.name for selector in item.selectors)
    if types != tuple(datatype.name for datatype in target.key):
        raise NftError(f"key {types} does not fit @{name}'s {[t.name for t in target.key]}")
    if isinstance(item, Update) and "dynamic" not in target.flags:
        raise NftError(f"update of @{name}, which is not dynamic")


def _kind(target: NamedSet, is_map: bool) -> NamedSet:
    if target.is_map != is_map:
        raise NftError(f"{target.name} is {'a map' if target.is_map else 'a set'}")
    return target


def _add_set(table: Table, name: str, tokens: Tokens, is_map: bool) -> None:
    declared = _set_declaration(name, tokens, table.family, is_map)
    existing = table.sets.get(name)
    if existing is None:
        table.sets[name] = declared
    elif (existing.key, existing.data, existing.flags) != (
        declared.key,
        declared.data,
        declared.flags,
    ):
        raise NftError(f"set {name} exists with another declaration")


def _delete_set(table: Table, name: str, is_map: bool) -> None:
    _kind(table.named_set(name), is_map)
    if any(name in rule.sets() for rule in table.rules()):
        raise NftError(f"set {name} is still used by a rule")
    del table.sets[name]


def _overlaps(first: Key, second: Key) -> bool:
    return all(
        a_low <= b_high and b_low <= a_high
        for (a_low, a_high), (b_low, b_high) in zip(first, second, strict=True)
    )


def _add_elements(table: Table, target: NamedSet, tokens: Tokens) -> None:
    for key, value in _elements(tokens, target, with_values=True):
        if "interval" not in target.flags and any(first != last for first, last in key):
            raise NftError(f"a range in {target.name}, which has no interval flag")
        if isinstance(value, Verdict) and value.chain is not None:
            table.chain(value.chain)
        if key in target.elements:
            if target.elements[key] != value:
                raise NftError(f"{target.name} holds the key with another value")
            continue
        if "interval" in target.flags and any(_overlaps(key, held) for held in target.elements):
            raise NftError(f"an element overlapping another in {target.name}")
        target.elements[key] = value


def _delete_elements(target: NamedSet, tokens: Tokens) -> None:
    for key, _ in _elements(tokens, target, with_values=False):
        if key not in target.elements:
            raise NftError(f"no such element in {target.name}")
        del target.elements[key]


def _add_counter(objects: set[str], name: str, tokens: Tokens) -> None:
    if not tokens.done():
        raise NftError(f"a counter with options: {tokens.text!r}")
    objects.add(name)


def _add_limit(table: Table, name: str, tokens: Tokens) -> None:
    for clause in _clauses(tokens):
        clause.expect("rate")
        if not re.fullmatch(r"\d+/second", clause.take()):
            raise NftError(f"unknown limit rate in {clause.text!r}")
        clause.expect("burst")
        clause.number()
        clause.expect("packets")
        _finished(clause)
    table.limits.add(name)


def _delete_object(table: Table, objects: set[str], name: str) -> None:
    if name not in objects:
        raise NftError(f"no object {name} to delete")
    if any(name in rule.objects() for rule in table.rules()):
        raise NftError(f"{name} is still used by a rule")
    objects.remove(name)


def applied(transactions: Iterable[str], ruleset: Ruleset | None = None) -> Ruleset:
    """A ruleset (a new one unless given) with the transactions applied in order."""
    ruleset = ruleset or Ruleset()
    for text in transactions:
        ruleset.apply(text)
    return ruleset
