"""One kind of watched object, parsed, by namespace and name: what a watch's events and its
fresh lists feed, for the proxy's tracker and the policy's state alike.

An object that cannot be parsed is logged with its namespace and name (model.parse_or_skip)
and is absent, as is one the parser leaves out (returning None). The owner hears each change
through `on_set`, under whatever lock it holds around the store, with the object that was
there and the one that replaced it; an update that parses to what is there already is none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from proxyd.model import Obj, key_of, parse_or_skip

Parsed = TypeVar("Parsed")
Key = tuple[str, str]


class Store(Generic[Parsed]):
    def __init__(
        self,
        kind: str,
        parse: Callable[[Obj], Parsed | None],
        on_set: Callable[[Key, Parsed | None, Parsed | None], None] = lambda *_: None,
    ) -> None:
        self.kind = kind
        self._parse = parse
        self._on_set = on_set
        self.items: dict[Key, Parsed] = {}
        self.listed = False
        """A fresh list has arrived."""

    def set(self, key: Key, obj: Obj | None) -> bool:
        """The object under key is now obj (None: gone); whether what is stored changed."""
        parsed = parse_or_skip(self._parse, obj, self.kind) if obj is not None else None
        old = self.items.get(key)
        if parsed == old:
            return False
        if parsed is None:
            del self.items[key]
        else:
            self.items[key] = parsed
        self._on_set(key, old, parsed)
        return True

    def event(self, kind: str, obj: Obj) -> bool:
        """A watch event (ADDED, MODIFIED, DELETED); whether what is stored changed."""
        return self.set(key_of(obj), None if kind == "DELETED" else obj)

    def replace(self, objs: list[Obj]) -> bool:
        """A fresh list: what it lacks is gone; whether what is stored changed. The caller
        empties the list once it let go of its lock (ClusterState, PolicyState), so that
        the watch's objects are freed before the sync is queued, not while it runs."""
        present = {key_of(obj): obj for obj in objs}
        changed = [self.set(key, None) for key in list(self.items.keys() - present.keys())]
        changed += [self.set(key, obj) for key, obj in present.items()]
        self.listed = True
        return any(changed)
