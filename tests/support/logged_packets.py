"""What the policy table's log rules would report, for the tests of flow records and staged
policies: a logging of every verdict, the log prefix's pattern in rendered rules, and a
logged packet made from a rule's words."""

from __future__ import annotations

import re

from proxyd.policy.compile import ALLOW, DROP
from proxyd.policy.flowlog import Logged, Logging

EVERY_VERDICT = Logging(1000, frozenset({ALLOW, DROP}))
PREFIX = re.compile(r'log prefix "([^"]*)"')


def logged(text: str, source: str, destination: str, port: int, protocol: str = "tcp") -> Logged:
    """A packet from source:40000 that the rule `text` ("CHAIN INDEX|end VERDICT") logged."""
    chain, index, verdict = text.split(" ")
    at = None if index == "end" else int(index)
    return Logged(chain, at, verdict, protocol, source, 40000, destination, port, 0.0)
