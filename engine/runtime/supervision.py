"""What the root's code may use of a supervisor, whether it supervises one pipeline of actors
(`Supervisor`) or several side by side (the data-parallel `ReplicaSet`): one interface, two
implementations, so that callers never ask which one they hold."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from engine.runtime.events import ChildStatus, SupervisorEvent

Received = list[tuple[str, list[bytes]]]  # (logical ring name, frames), oldest first


class RootEnds(Protocol):
    """The root's own ends of the rings it writes and reads."""

    async def send_many(self, ring: str, frames: Sequence[bytes]) -> bool:
        """Write `frames` to `ring`; False when its reader restarted while we waited (the
        frames were for the old one)."""
        ...

    async def recv(self) -> Received:
        """What arrived on any inbound ring; RingClosed once the ends are closed."""
        ...


class Supervision(Protocol):
    @property
    def root(self) -> RootEnds: ...

    async def start(self) -> None: ...

    async def shutdown(self, reason: str = "shutdown requested") -> None: ...

    async def wait_closed(self) -> str: ...

    def subscribe(self) -> asyncio.Queue[SupervisorEvent]: ...

    def status(self) -> list[ChildStatus]: ...

    def set_log_level(self, level: str) -> None: ...
