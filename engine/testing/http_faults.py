"""Fault injection in the HTTP server, for tests: a request whose body holds a chosen marker fails
as a bug in the server's own code would, so a test can see what a client gets then.

When the environment variable ENGINE_HTTP_FAULT_INJECTION is set (never by the engine itself;
nothing a client sends can set it), the value is a comma-separated list of ACTION:MARKER, e.g.
`raise:boom-1,raise-in-stream:boom-2`, with ACTION one of:
- `raise`: the completions handler raises after parsing the request, before any engine request
  starts (the generic handler answers 500);
- `raise-in-stream`: a streamed response raises after its first event has been sent.
A MARKER is any text without commas; a request trips a rule when its raw body contains it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

HTTP_FAULT_INJECTION_ENV = "ENGINE_HTTP_FAULT_INJECTION"

_RULE = re.compile(r"(raise-in-stream|raise):([^,]+)")


class InjectedHttpFault(RuntimeError):
    """Raised by HTTP fault injection; never seen unless a test asked for it."""


class HttpFaults:
    """Which request bodies make the server fail, and where; empty unless a test configured it."""

    def __init__(self, spec: str = "") -> None:
        self.rules: dict[bytes, str] = {}  # marker -> action
        for part in filter(None, (p.strip() for p in spec.split(","))):
            match = _RULE.fullmatch(part)
            if match is None:
                raise ValueError(
                    f"{HTTP_FAULT_INJECTION_ENV} entry {part!r} must be ACTION:MARKER with "
                    "ACTION one of raise, raise-in-stream, e.g. 'raise:boom'"
                )
            action, marker = match.groups()
            self.rules[marker.encode()] = action

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> HttpFaults:
        return cls(environ.get(HTTP_FAULT_INJECTION_ENV, ""))

    def actions(self, body: bytes) -> frozenset[str]:
        """The actions this request body trips (none, and at no cost, when nothing is on)."""
        if not self.rules:
            return frozenset()
        return frozenset(action for marker, action in self.rules.items() if marker in body)

    @staticmethod
    def trip(actions: frozenset[str], action: str) -> None:
        if action in actions:
            raise InjectedHttpFault(f"injected HTTP fault ({action})")
