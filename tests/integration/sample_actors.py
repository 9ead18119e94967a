"""Small actors for the runtime's integration tests, and helpers to watch processes.

Spawned children import these by name ("tests.integration.sample_actors:EchoActor"), so this
module must stay importable without pytest.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from engine.actors.runtime.actor import Actor
from engine.messages.codec import Channel


class Note(msgspec.Struct, tag=True, array_like=True):
    text: str


NOTES: Channel[Note] = Channel("test-notes", Note)


class EchoConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    stop_log: str = ""  # a file the actor appends its name to in on_stop (shows the stop order)
    pid_file: str = ""  # a file the actor writes its pid to first thing in on_start
    never_ready: bool = False  # on_start never returns
    exit_after_ready: float = -1.0  # >= 0: exit with status 3 this many seconds after Ready
    stall_reading: bool = False  # handle() never returns: its inbound ring fills up


class EchoActor(Actor):
    """Forwards every Note to outbound ring "out" (if it has one) as "<name>:<text>".

    A note whose text ends with "crash <name>" makes this actor crash (an exception in handle).
    """

    channels = (NOTES,)

    async def on_start(self) -> dict[str, Any] | None:
        self.settings = msgspec.msgpack.decode(self.config or b"\x80", type=EchoConfig)
        if self.settings.pid_file:
            Path(self.settings.pid_file).write_text(str(os.getpid()))
        if self.settings.never_ready:
            await asyncio.Event().wait()
        if self.settings.exit_after_ready >= 0:
            asyncio.get_running_loop().call_later(self.settings.exit_after_ready, os._exit, 3)
        return {"pid": os.getpid(), "generation": self.generation}

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        if self.settings.stall_reading:
            await asyncio.Event().wait()
        for note in NOTES.decode_many(frames):
            if note.text.endswith(f"crash {self.name}"):
                raise RuntimeError(f"{self.name} was asked to crash")
            if "out" in self.rings.outbound_names:
                await self.send("out", NOTES.encode(Note(f"{self.name}:{note.text}")))

    async def on_stop(self) -> None:
        if self.settings.stop_log:
            with open(self.settings.stop_log, "a") as log:
                log.write(f"{self.name}\n")


def echo_config(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(EchoConfig(**fields))


def pid_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an orphan nobody reaped is dead too)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` (for things that give no event: other processes' lives, files)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)


async def async_wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.02)
