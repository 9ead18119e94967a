"""Telling a crash from a kill, and gathering restarts reported together (for AsyncLLM)."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

from engine.runtime.events import ChildDied, ChildRestarted
from engine.runtime.stopped import STOPPED_FROM_OUTSIDE

# Signals that only ever come from outside an actor: an operator, the OOM killer, a test.
_EXTERNAL_SIGNALS = frozenset({signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def is_crash(event: ChildDied) -> bool:
    """Whether a death may be a request's doing: an exception that escaped (status != 0), a
    native crash (SIGSEGV, SIGABRT, ...) or a hang the supervisor killed. A kill from outside
    the engine is not, nor a child the supervisor killed because it had been stopped from
    outside (SIGSTOP); the supervisor names its own kills in the reason, nobody else does."""
    if event.exitcode == 0 or STOPPED_FROM_OUTSIDE in event.reason:
        return False
    if event.exitcode > 0:
        return True
    try:
        sig = signal.Signals(-event.exitcode)
    except ValueError:
        return True
    return sig not in _EXTERNAL_SIGNALS or event.reason != f"was killed by {sig.name}"


def drain_restarts(events: asyncio.Queue[Any]) -> list[str]:
    """Names of further ChildRestarted events already queued (other events are kept)."""
    names, others = [], []
    while not events.empty():
        event = events.get_nowait()
        if isinstance(event, ChildRestarted):
            names.append(event.name)
        else:
            others.append(event)
    for event in others:
        events.put_nowait(event)
    return names
