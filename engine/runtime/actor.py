"""The Actor base class, and `child_main`: what every spawned child process runs.

An actor's life: start (on_start loads its resources; what it returns goes to the root in Ready)
-> run (handle frames from all its inbound rings, awaited together through one Mailbox; beat
its heart) -> stop (a Stop message, SIGTERM, or its own `stop()`: on_stop, Exiting, exit 0).
An exception escaping a hook crashes the actor (exit 1) and its supervisor decides what next.

Control traffic from the root (Stop, SwapRings, LogLevel) is served by its own task, so a ring
swap still reaches an actor whose handler is waiting to send to a restarted peer.

Heartbeats come from the event loop, so an actor whose loop is stuck stops beating and its
supervisor kills it. Work that may legitimately take longer than the heartbeat timeout (a
worker's model step, on the loop or in a thread) runs inside `busy()`: meanwhile a thread beats,
so liveness does not depend on how long a step takes. A stopped process (SIGSTOP) beats from
neither; a step that can never end (a collective a peer never joins) ends with the collectives'
own bounded timeout.
"""

from __future__ import annotations

import asyncio
import ctypes
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar, TypeVar

import uvloop

from engine.messages.codec import Channel
from engine.messages.control import (
    BOOT,
    CONTROL,
    STATUS,
    ChildBoot,
    Exiting,
    Heartbeat,
    LogLevel,
    Ready,
    StatusMessage,
    Stop,
    SwapDone,
    SwapRings,
)
from engine.messages.rings import Ring
from engine.runtime.child_spec import LOG_LEVELS
from engine.runtime.ring import RingReader, RingWriter
from engine.runtime.ring_ends import RingEnds

T = TypeVar("T")

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


class Actor:
    """Subclass and override the hooks; the runtime calls them on the actor's own event loop."""

    # Channels this actor decodes with; their malformed-frame counts go to the root in heartbeats.
    channels: ClassVar[tuple[Channel[Any], ...]] = ()
    # The role its ChildSpec gives it: the party it is in the rings it reads and writes
    # (engine/messages/ring_catalogue.py); "" for an actor outside the catalogue.
    role: ClassVar[str] = ""

    def __init__(self, boot: ChildBoot) -> None:
        self.name = boot.name
        self.config = boot.config  # the actor's own settings, in whatever encoding its spec used
        self.generation = boot.generation
        self.log = logging.getLogger(f"engine.actor.{boot.name}")
        self.rings = RingEnds(boot.inbound, boot.outbound)
        self.segments = boot.segments  # logical name -> shared-memory name (SegmentDecl)
        self.run_dir = boot.run_dir  # the root's run directory in /dev/shm (a name)
        self._boot = boot
        self._control = RingReader(boot.control)
        self._status = RingWriter(boot.status)
        self._stop_requested: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._status_lock = threading.Lock()  # the status ring has one writer: either thread
        self._beats = 0
        self._busy_since: float | None = None  # set inside busy()
        self._busy_limit = 0.0  # the deadline busy() was given, in seconds; 0: none
        self._loop_seen = time.monotonic()  # when the event loop last turned
        self._ended = threading.Event()  # tells the heartbeat thread to end
        self._status_closed = False

    # Hooks.

    @classmethod
    def preload(cls) -> None:
        """Import what on_start will need, in a spare process that does not yet know which
        child it will be (engine/runtime/spares.py): nothing that depends on the config,
        and nothing held that a second copy would cost memory for."""

    async def on_start(self) -> dict[str, Any] | None:
        """Load resources. The returned info goes to the root in the Ready message."""
        return None

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        """Frames that arrived on inbound ring `ring` (its logical name), oldest first."""
        raise NotImplementedError(f"{type(self).__name__} reads rings but does not define handle()")

    async def on_stop(self) -> None:
        """Release resources; runs on every orderly stop after a successful on_start."""

    async def on_rings_swapped(self, peer: str, rings: list[str]) -> None:
        """`peer` restarted and these rings are fresh; what was in flight to or from it is gone."""

    # Services.

    async def send_to(self, ring: Ring[T], message: T) -> bool:
        """Encode `message` for outbound ring `ring` and write it; False if the ring was swapped
        while waiting."""
        return await self.rings.send_many(ring.name, (ring.encode(message),))

    async def send_all(self, ring: Ring[T], messages: Sequence[T]) -> bool:
        """Encode `messages` for outbound ring `ring` and write them, oldest first."""
        return await self.rings.send_many(ring.name, [ring.encode(m) for m in messages])

    async def send(self, ring: Ring[Any] | str, frame: bytes) -> bool:
        """Write one frame, encoded already (with the ring's channel), to outbound ring `ring`;
        False if the ring was swapped while waiting."""
        return await self.rings.send_many(_name(ring), (frame,))

    async def send_many(self, ring: Ring[Any] | str, frames: Sequence[bytes]) -> bool:
        """Write frames, encoded already (with the ring's channel; e.g. split to fit a frame),
        to outbound ring `ring`; False if the ring was swapped while waiting."""
        return await self.rings.send_many(_name(ring), frames)

    @contextmanager
    def busy(self, limit: float = 0.0) -> Iterator[None]:
        """Mark work that may hold the event loop longer than the stall timeout (a model step):
        the root judges it by `limit` seconds instead (0: no deadline), which the work derives
        from its own size. Heartbeats never stop: they come from a thread. Any thread."""
        self._busy_limit = limit
        self._busy_since = time.monotonic()
        try:
            yield
        finally:
            self._busy_since = None
            self._busy_limit = 0.0

    def stop(self, reason: str) -> None:
        """Ask for an orderly stop (also what a Stop message and SIGTERM do)."""
        if not self._stop_requested.done():
            self.log.info("stopping: %s", reason)
            self._stop_requested.set_result(reason)

    @property
    def decode_errors(self) -> int:
        return CONTROL.decode_errors + sum(channel.decode_errors for channel in self.channels)

    # The runtime.

    async def run(self) -> int:
        """The actor's whole life; returns the process exit status."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop, "SIGTERM")
        tasks = [loop.create_task(self._serve_control(), name="control")]
        started, reason, status = False, "", 0
        try:
            starting = loop.create_task(self.on_start(), name="on_start")
            await asyncio.wait((starting, self._stop_requested), return_when="FIRST_COMPLETED")
            if starting.done():
                info = starting.result()
                started = True
                self._report(Ready(os.getpid(), info or {}))
                self.log.info("ready (generation %d)", self.generation)
                tasks.append(loop.create_task(self._mark_loop_turns(), name="loop-turns"))
                threading.Thread(target=self._beat_heart, name="heartbeat", daemon=True).start()
                if self.rings.inbound_names:
                    tasks.append(loop.create_task(self._serve(), name="serve"))
                waits: list[asyncio.Future[Any]] = [*tasks, self._stop_requested]
                await asyncio.wait(waits, return_when="FIRST_COMPLETED")
            else:
                await _cancel(starting)
            if not self._stop_requested.done():  # then one of the tasks ended: a crash
                for task in tasks:
                    if task.done():
                        task.result()
                        raise RuntimeError(f"actor task {task.get_name()!r} ended on its own")
            reason = self._stop_requested.result()
        except Exception as exc:
            self.log.exception("crashed")
            reason, status = f"crashed: {exc!r}", 1
        finally:
            self._ended.set()
            for task in tasks:
                await _cancel(task)
            if started:
                try:
                    await self.on_stop()
                except Exception as exc:
                    self.log.exception("on_stop failed")
                    reason, status = f"{reason}; on_stop failed: {exc!r}", 1
            self._report(Exiting(reason))
            self.rings.close()
            self._control.close()
            with self._status_lock:  # the busy-beat thread may be about to report
                self._status.close()
                self._status_closed = True
        return status

    async def _serve(self) -> None:
        mailbox = self.rings.mailbox
        while True:
            for ring, frames in await mailbox.recv():
                await self.handle(ring, frames)

    async def _serve_control(self) -> None:
        while True:
            for message in CONTROL.decode_many(await self._control.recv_many()):
                if isinstance(message, Stop):
                    self.stop(message.reason)
                elif isinstance(message, SwapRings):
                    self.rings.swap(message.inbound, message.outbound)
                    rings = sorted({*message.inbound, *message.outbound})
                    self.log.info("peer %s restarted: swapped rings %s", message.peer, rings)
                    await self.on_rings_swapped(message.peer, rings)
                    self._report(SwapDone(message.swap_id))
                elif isinstance(message, LogLevel):
                    _set_log_level(message.level, self.log)

    async def _mark_loop_turns(self) -> None:
        """The event loop's sign of life, which heartbeats carry as `loop_lag`."""
        while True:
            self._loop_seen = time.monotonic()
            await asyncio.sleep(self._boot.heartbeat_interval)
            if os.getppid() != self._boot.root_pid:  # backs up the death signal (non-Linux too)
                self.stop("the root process is gone")
                return

    def _beat_heart(self) -> None:
        """The heartbeat thread: nothing the actor computes can hold it up (a step runs in
        native code without the GIL, or on another thread), so silence means the process is
        stopped or stuck as a whole; how the event loop and a step fare, the beats say."""
        while not self._ended.wait(self._boot.heartbeat_interval):
            self._beat()

    def _beat(self) -> None:
        with self._status_lock:
            self._beats += 1
            rings = self.rings  # dict() copies are atomic: the loop may be sending meanwhile
            now, since, limit = time.monotonic(), self._busy_since, self._busy_limit
            beat = Heartbeat(
                self._beats,
                self.decode_errors,
                dict(rings.frames_sent),
                dict(rings.bytes_sent),
                rings.fill(),
                loop_lag=now - self._loop_seen,
                busy_for=0.0 if since is None else now - since,
                busy_limit=limit,
            )
        self._report(beat)

    def _report(self, message: StatusMessage) -> None:
        # Never waits: a root too busy to read status loses a heartbeat, not the actor's loop.
        # A heartbeat rings no doorbell: the root's watchdog reads every status ring each
        # heartbeat interval anyway, and waking it for each one was most of an idle root's work.
        with self._status_lock:
            if not self._status_closed:
                quiet = isinstance(message, Heartbeat)
                self._status.try_send_many([STATUS.encode(message)], quiet=quiet)


def _name(ring: Ring[Any] | str) -> str:
    return ring if isinstance(ring, str) else ring.name


def child_main(boot_frame: bytes) -> None:
    """Entry of a spawned child: an encoded ChildBoot in, the actor's exit status out."""
    boot = BOOT.decode(boot_frame)
    exit_with_root(boot.root_pid)
    # Ctrl-C reaches the whole process group; shutting down is the root's call, not ours.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=boot.log_level,
        format=f"%(asctime)s %(levelname)s {boot.name}[%(process)d] %(name)s: %(message)s",
        force=True,
    )
    actor_class = load_actor_class(boot.entry)
    sys.exit(uvloop.run(_run_actor(actor_class, boot)))


def load_actor_class(entry: str) -> type[Actor]:
    module_name, colon, class_name = entry.partition(":")
    if not (colon and module_name and class_name):
        raise ValueError(f"actor entry must be 'module:Class', got {entry!r}")
    found = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(found, type) and issubclass(found, Actor)):
        raise TypeError(f"actor entry {entry!r} must name an Actor subclass, found {found!r}")
    return found


async def _run_actor(actor_class: type[Actor], boot: ChildBoot) -> int:
    return await actor_class(boot).run()


def exit_with_root(root_pid: int) -> None:
    """Make the kernel kill this process when the root dies, so no child outlives it.

    SIGKILL rather than SIGTERM: a hung child must go too; the next start sweeps its segments.
    The signal fires when the thread that spawned us exits, which is the root's event loop thread.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if os.getppid() != root_pid:  # the root died before the death signal was armed
        os._exit(1)


def _set_log_level(level: str, log: logging.Logger) -> None:
    if level not in LOG_LEVELS:
        log.error("ignored LogLevel %r: expected one of %s", level, LOG_LEVELS)
        return
    log.info("log level set to %s", level)
    logging.getLogger().setLevel(level)


async def _cancel(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and wait for it; an exception it ended with was reported already."""
    task.cancel()
    await asyncio.wait((task,))
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not warn about it again
