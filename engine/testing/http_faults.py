"""Fault injection in the HTTP server, for tests: a request whose prompt holds a chosen marker fails
as a bug in the server's own code would, so a test can see what a client gets then.

The server loads it through its hook (engine/runtime/hooks.py), which wraps the engine of each
model it loads: `environment(SPEC)` is what a test starts the server with. SPEC is a
comma-separated list of ACTION:MARKER, e.g. `raise:boom-1,raise-in-stream:boom-2`, with ACTION
one of:
- `raise`: the request fails as it is handed to the engine, before any engine request starts
  (the generic handler answers 500);
- `raise-in-stream`: the request fails once its first output has been relayed (a stream has
  sent its first events).
A MARKER is any text without commas; a request trips a rule when its prompt text (or a chat
message's content) holds it.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.messages.requests import EngineRequest
from engine.request.outputs import RequestOutput
from engine.runtime.hooks import HOOKS_ENV

HTTP_FAULT_INJECTION_ENV = "ENGINE_HTTP_FAULT_INJECTION"

_RULE = re.compile(r"(raise-in-stream|raise):([^,]+)")

log = logging.getLogger(__name__)

Submit = Callable[[EngineRequest], AsyncIterator[RequestOutput]]


class InjectedHttpFault(RuntimeError):
    """Raised by HTTP fault injection; never seen unless a test asked for it."""


class HttpFaults:
    """Which requests make the server fail, and where; empty unless a test configured it."""

    def __init__(self, spec: str = "") -> None:
        self.rules: dict[str, str] = {}  # marker -> action
        for part in filter(None, (p.strip() for p in spec.split(","))):
            match = _RULE.fullmatch(part)
            if match is None:
                raise ValueError(
                    f"{HTTP_FAULT_INJECTION_ENV} entry {part!r} must be ACTION:MARKER with "
                    "ACTION one of raise, raise-in-stream, e.g. 'raise:boom'"
                )
            action, marker = match.groups()
            self.rules[marker] = action

    def actions(self, request: EngineRequest) -> set[str]:
        """The actions this request trips."""
        texts = [request.prompt or "", *(m.content for m in request.messages or ())]
        return {action for marker, action in self.rules.items() if any(marker in t for t in texts)}

    def wrap(self, submit: Submit) -> Submit:
        """`submit` (AsyncLLM.submit) failing as the rules say."""

        async def faulty(request: EngineRequest) -> AsyncIterator[RequestOutput]:
            actions = self.actions(request)
            if "raise" in actions:
                raise InjectedHttpFault("injected HTTP fault (raise)")
            outputs = submit(request)
            try:
                async for output in outputs:
                    if "raise-in-stream" in actions:
                        output.finished = False  # the response must go on to fail, however fast
                        yield output
                        raise InjectedHttpFault("injected HTTP fault (raise-in-stream)")
                    yield output
            finally:
                await outputs.aclose()  # type: ignore[attr-defined]

        return faulty


def environment(spec: str) -> dict[str, str]:
    """The environment a server is started with for these faults."""
    return {HOOKS_ENV: __name__, HTTP_FAULT_INJECTION_ENV: spec}


def install_served_model(served: Any) -> None:
    """The hook of each model the HTTP server loads: the engine its routes call (served.llm)
    fails as configured."""
    faults = HttpFaults(os.environ.get(HTTP_FAULT_INJECTION_ENV, ""))
    if faults.rules:
        log.warning("HTTP fault injection is on: %s", faults.rules)
        served.llm.submit = faults.wrap(served.llm.submit)
