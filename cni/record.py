"""The base of the plugin's records (a call's invocation, config, IPAM ranges, links and
result): equality and repr by the fields their __slots__ name, as dataclasses would generate.

The plugin runs in a process of its own for every call the node daemon does not serve, and
importing dataclasses (which imports inspect, ast and dis) cost 8 ms of each such call on the
development machine (docs/benchmarks.md#the-in-process-path), where the reference plugin's
whole ADD takes 9-15 ms."""

from __future__ import annotations


class Record:
    __slots__: tuple[str, ...] = ()

    def _values(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Record)
        return self._values() == other._values()

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({fields})"
