"""Small actors for the runtime's integration tests, and helpers to run and watch them.

Spawned children import these by name ("tests.integration.sample_actors:EchoActor"), so this
module must stay importable without pytest. Run as a program it is a root process with two
children (the test that SIGKILLs a root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from engine.messages.codec import Channel
from engine.runtime.actor import Actor
from engine.runtime.child_spec import ChildSpec, RingDecl, SupervisorSpec
from engine.runtime.events import ChildReady, ChildStatus, SupervisorEvent
from engine.runtime.supervisor import Supervisor

ECHO = "tests.integration.sample_actors:EchoActor"
EVENT_TIMEOUT = 30.0  # generous: the machine is shared; no test measures time


class Note(msgspec.Struct, tag=True, array_like=True):
    text: str


NOTES: Channel[Note] = Channel("test-notes", Note)


class EchoConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    stop_log: str = ""  # a file the actor appends its name to in on_stop (shows the stop order)
    pid_file: str = ""  # a file the actor writes its pid to first thing in on_start
    never_ready: bool = False  # on_start never returns
    exit_after_ready: float = -1.0  # >= 0: exit with status 3 this many seconds after on_start
    stall_reading: bool = False  # handle() never returns: its inbound ring fills up
    hang_on_stop: bool = False  # on_stop never returns: only SIGKILL ends the actor


class EchoActor(Actor):
    """Forwards every Note to each of its outbound rings as "<name>:<text>".

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
        return {"generation": self.generation}

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        if self.settings.stall_reading:
            await asyncio.Event().wait()
        for note in NOTES.decode_many(frames):
            if note.text.endswith(f"crash {self.name}"):
                raise RuntimeError(f"{self.name} was asked to crash")
            await self._work(note.text)
            for out in self.rings.outbound_names:
                await self.send(out, NOTES.encode(Note(f"{self.name}:{note.text}")))

    async def _work(self, text: str) -> None:
        """'step S LIMIT': a model step's stand-in, S seconds on a thread inside busy(LIMIT);
        'block S': S seconds holding the event loop, as code stuck on it would; 'gil N': one
        native call that holds the GIL (and so the heartbeat thread) while it computes."""
        verb, *numbers = text.split()
        if verb == "step":
            seconds, limit = map(float, numbers)
            await asyncio.to_thread(self._step, seconds, limit)
        elif verb == "block":
            time.sleep(float(numbers[0]))
        elif verb == "gil":
            sum(range(int(numbers[0])))  # one C call: no bytecode boundary to switch threads at

    def _step(self, seconds: float, limit: float) -> None:
        with self.busy(limit):
            time.sleep(seconds)

    async def on_stop(self) -> None:
        if self.settings.hang_on_stop:
            await asyncio.Event().wait()
        if self.settings.stop_log:
            with open(self.settings.stop_log, "a") as log:
                log.write(f"{self.name}\n")


def echo_config(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(EchoConfig(**fields))


def child(name: str, **fields: Any) -> ChildSpec:
    """An EchoActor child with test-sized timeouts."""
    defaults: dict[str, Any] = {
        "entry": ECHO,
        "shutdown_timeout": 2.0,
        "ready_timeout": EVENT_TIMEOUT,
        "heartbeat_interval": 0.1,
        "heartbeat_timeout": 5.0,
    }
    return ChildSpec(name=name, **{**defaults, **fields})


def supervisor_spec(*children: ChildSpec, **fields: Any) -> SupervisorSpec:
    defaults: dict[str, Any] = {
        "max_restarts": 5,
        "max_seconds": 60.0,
        "backoff_initial": 0.01,
        "backoff_max": 0.05,
    }
    return SupervisorSpec(children=children, **{**defaults, **fields})


def echo_rings(actor: str = "echo") -> tuple[RingDecl, ...]:
    """root -in-> actor -out-> root"""
    return (
        RingDecl(name="in", writer="root", readers=(actor,), capacity=4096),
        RingDecl(name="out", writer=actor, readers=("root",), capacity=4096),
    )


E = TypeVar("E", bound=SupervisorEvent)


class Run:
    """A started supervisor, its event queue, and every child pid it reported ready."""

    def __init__(self, supervisor: Supervisor, events: asyncio.Queue[SupervisorEvent]) -> None:
        self.supervisor = supervisor
        self.events = events
        self.pids: set[int] = set()

    async def next(self, kind: type[E], name: str | None = None) -> E:
        """The next event of `kind` (about child `name`, if given), skipping others."""
        while True:
            event = self._seen(await asyncio.wait_for(self.events.get(), EVENT_TIMEOUT))
            if isinstance(event, kind) and (name is None or getattr(event, "name", None) == name):
                return event

    def row(self, name: str) -> ChildStatus:
        return next(row for row in self.supervisor.status() if row.name == name)

    def pid(self, name: str) -> int:
        pid = self.row(name).pid
        assert pid is not None, f"{name} is not running"
        return pid

    async def send(self, text: str) -> None:
        """Send a Note into ring "in", expecting no answer."""
        assert await self.supervisor.root.send_many("in", [NOTES.encode(Note(text))])

    async def roundtrip(self, text: str) -> str:
        """Send a Note into ring "in"; the text of the Note that comes back on ring "out"."""
        assert await self.supervisor.root.send_many("in", [NOTES.encode(Note(text))])
        [(ring, frames)] = await asyncio.wait_for(
            self.supervisor.root.mailbox.recv(), EVENT_TIMEOUT
        )
        assert ring == "out"
        return NOTES.decode(frames[0]).text

    def _seen(self, event: SupervisorEvent) -> SupervisorEvent:
        if isinstance(event, ChildReady):
            self.pids.add(event.pid)
        return event

    def assert_no_child_left(self) -> None:
        while not self.events.empty():
            self._seen(self.events.get_nowait())
        assert self.pids, "no child was ever ready"
        left = [pid for pid in self.pids if pid_running(pid)]
        assert not left, f"children {left} outlived the supervisor"


@contextlib.asynccontextmanager
async def supervised(spec: SupervisorSpec) -> AsyncIterator[Run]:
    """Start a supervisor; afterwards shut it down and check that no child it ran is left."""
    supervisor = Supervisor(spec)
    run = Run(supervisor, supervisor.subscribe())
    await supervisor.start()
    try:
        yield run
    finally:
        await supervisor.shutdown("test over")
        run.assert_no_child_left()


def pid_running(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (an orphan nobody reaped is dead too)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition`: for what sends no event (other processes' lives, files)."""
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


async def serve_as_root(info_path: str) -> None:
    """A root process with two children and a spare process; writes {"root": pid, "children":
    [pids], "spares": [pids]} when ready."""
    spec = supervisor_spec(child("one"), child("two"), rings=echo_rings("one"), spares=True)
    async with Supervisor(spec) as supervisor:
        await async_wait_until(lambda: bool(supervisor.spare_pids()), 60, "its spare")
        info = {
            "root": os.getpid(),
            "children": [row.pid for row in supervisor.status()],
            "spares": list(supervisor.spare_pids().values()),
        }
        Path(info_path + ".tmp").write_bytes(msgspec.json.encode(info))
        os.replace(info_path + ".tmp", info_path)
        await supervisor.wait_closed()


if __name__ == "__main__":
    asyncio.run(serve_as_root(sys.argv[1]))
