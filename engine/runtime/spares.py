"""Spare processes: what a restart would spend on becoming a process, spent before the failure.

A restarted child's recovery is mostly its new process's start: the interpreter, the engine's
modules, and what its actor imports to start (torch, for a worker). So a supervisor may keep one
spare per entry ("module:Class") of its restartable children: a process spawned as a child is,
that has imported its actor's module and runs the class's `preload()` on a thread, while it waits,
blocked in one read of a pipe (no polling: it uses no CPU), for the ChildBoot of the child it is
to become. A restart writes the boot into that pipe (msgspec bytes, as a fresh child gets them:
nothing is unpickled) and the spare goes on as `child_main` would, so the restart pays only the
actor's own `on_start`. A boot may be handed to a spare still starting: it reads it once its
actor's module is imported, never later than a fresh process would have.

The first spares start once the run is quiet (refill_when_quiet): each spare's start costs CPU
(its interpreter, then torch for a worker's), which beside the first requests of an engine just
started would slow them. A spare started after a restart starts at once: the next restart of
that actor should find it ready.

A spare holds nothing of the run (its rings, segments and weights come with the boot, or from
/dev/shm), only imported modules. It dies with the root: the kernel's parent-death signal, armed
first thing, and the end of its pipe, which only the root holds. The supervisor kills its spares
when it shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from engine.runtime.actor import child_main, exit_with_root, load_actor_class
from engine.runtime.events import ChildStatus
from engine.runtime.process_cpu import cpu_seconds

__all__ = ["Spare", "Spares", "spare_main"]

log = logging.getLogger(__name__)

_SPAWN = multiprocessing.get_context("spawn")
# A boot frame waits in the pipe until the spare reads it: the root never blocks on the write as
# long as the frame fits the pipe's buffer (64 KiB on Linux), with room for the length header.
MAX_BOOT_BYTES = 60 * 1024
_REAP_WAIT_S = 5.0  # after SIGKILL, for a spare to be gone
_DISCARD_REAP_S = 1.0  # the same, on the event loop: past it, multiprocessing reaps it later
# The first spares wait for a quiet run: its processes using under this many cores over one poll,
# or at most _QUIET_WAIT_S.
_QUIET_CORES = 0.25
_QUIET_POLL_S = 0.5
_QUIET_WAIT_S = 30.0


class Spare:
    """One spare process for children of `entry`, spawned on creation."""

    def __init__(self, entry: str) -> None:
        self.entry = entry
        reader, self._writer = _SPAWN.Pipe(duplex=False)
        self.process: BaseProcess = _SPAWN.Process(
            target=spare_main,
            args=(entry, os.getpid(), reader),
            name=f"spare {entry}",
            daemon=True,  # as children: multiprocessing's exit hook ends it with the root
        )
        self.process.start()
        reader.close()  # only the spare holds the read end: it sees EOF when the root is gone

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.exitcode is None

    def hand_over(self, boot_frame: bytes) -> BaseProcess | None:
        """The spare's process, now becoming the child `boot_frame` describes; None when it
        cannot (it died, or the frame does not fit the pipe's buffer): then spawn afresh."""
        if not self.alive or len(boot_frame) > MAX_BOOT_BYTES:
            self._give_up()
            return None
        try:
            self._writer.send_bytes(boot_frame)
        except OSError as exc:  # it died meanwhile: its read end is closed
            log.warning("spare %s (pid %s) could not take a boot: %s", self.entry, self.pid, exc)
            self._give_up()
            return None
        self._writer.close()
        return self.process

    def _give_up(self) -> None:
        """Discard it and reap it: taken from Spares, nothing else would, and it would stay a
        zombie child until the root exits."""
        self.discard()
        self.process.join(_DISCARD_REAP_S)  # a SIGKILLed process is gone within milliseconds

    def discard(self) -> None:
        """Kill it, if it runs still (it holds nothing to clean up)."""
        if not self._writer.closed:
            self._writer.close()
        if self.alive:
            self.process.kill()


class Spares:
    """At most one spare per entry; `refill()` spawns the missing ones (call it on the loop
    thread: the parent-death signal fires when the spawning thread ends)."""

    def __init__(self, entries: Iterable[str]) -> None:
        self._entries = sorted(set(entries))
        self._spares: dict[str, Spare] = {}
        self._closed = False

    def refill(self) -> None:
        if self._closed:
            return
        for entry in self._entries:
            spare = self._spares.get(entry)
            if spare is not None and not spare.alive:
                log.warning("spare %s (pid %s) died: replacing it", entry, spare.pid)
                self._retire(entry)
                spare = None
            if spare is None:
                self._spares[entry] = spare = Spare(entry)
                log.info("started a spare for %s as pid %s", entry, spare.pid)

    async def refill_when_quiet(self, children: Callable[[], Iterable[ChildStatus]]) -> None:
        """refill() once the run (this process and its `children()`, read at each poll) is
        quiet, or after _QUIET_WAIT_S at the latest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _QUIET_WAIT_S
        used = _cpu_of(children())
        while loop.time() < deadline:
            await asyncio.sleep(_QUIET_POLL_S)
            before, used = used, _cpu_of(children())
            if used - before < _QUIET_CORES * _QUIET_POLL_S:  # a restarted pid reads as quiet
                break
        self.refill()

    def take(self, entry: str) -> Spare | None:
        """The spare for `entry`, no longer kept (refill() replaces it), or None."""
        return self._spares.pop(entry, None)

    def pids(self) -> dict[str, int | None]:
        """Entry -> pid of each spare kept now."""
        return {entry: spare.pid for entry, spare in self._spares.items()}

    async def close(self) -> None:
        """Kill every spare kept and wait until each is gone; no refill() after this."""
        self._closed = True
        spares = list(self._spares.values())
        self._spares.clear()
        for spare in spares:
            spare.discard()
        await asyncio.gather(*(asyncio.to_thread(s.process.join, _REAP_WAIT_S) for s in spares))
        for spare in spares:
            if spare.process.exitcode is None:
                log.error("spare %s (pid %s) survived SIGKILL", spare.entry, spare.pid)
            else:
                spare.process.close()

    def _retire(self, entry: str) -> None:
        spare = self._spares.pop(entry)
        spare.discard()
        spare.process.join(0)  # reaps it: it is dead already


def _cpu_of(children: Iterable[ChildStatus]) -> float:
    pids = [os.getpid(), *(child.pid for child in children if child.pid is not None)]
    return sum(cpu_seconds(pid) or 0.0 for pid in pids)


def spare_main(entry: str, root_pid: int, boot_reader: Connection) -> None:
    """Entry of a spare process: import, wait for a boot, then run that child."""
    exit_with_root(root_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a child: the root decides about Ctrl-C
    actor_class = load_actor_class(entry)
    # On a thread, so that a boot handed over meanwhile is not held up by imports its actor may
    # not need before it is ready (the tokenizer's transformers); imports of the same modules by
    # the actor wait for this thread's instead of repeating them.
    threading.Thread(target=actor_class.preload, name="preload", daemon=True).start()
    try:
        boot_frame = boot_reader.recv_bytes()
    except EOFError:  # the root is gone, or let the spare go
        os._exit(0)
    boot_reader.close()
    child_main(boot_frame)
