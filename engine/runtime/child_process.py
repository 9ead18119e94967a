"""The root's handle on one generation of one child: its process, its control rings, its exit.

Policy (whether and what to restart) lives in the supervisor; this module only starts a process,
listens to it, and stops it: Stop message, then SIGTERM, then SIGKILL, each after a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping

from engine.messages.control import (
    BOOT,
    CONTROL,
    STATUS,
    ChildBoot,
    ControlMessage,
    Exiting,
    Heartbeat,
    InboundRing,
    Ready,
    Stop,
    SwapDone,
    SwapRings,
)
from engine.runtime.actor import child_main
from engine.runtime.child_spec import ChildSpec
from engine.runtime.ring import RingReader, RingSpec, RingWriter, create_ring, destroy_ring
from engine.runtime.shm import run_directory_of
from engine.runtime.spares import Spare

log = logging.getLogger(__name__)

CONTROL_RING_BYTES = 64 * 1024  # control traffic is a few small messages per second at most
_KILL_WAIT = 10.0  # after SIGKILL: only a process stuck in the kernel takes longer
_SPAWN = multiprocessing.get_context("spawn")  # a fresh interpreter: safe with CUDA, no fork state


class ChildStartError(RuntimeError):
    """A child did not become ready; the message names it and says what happened."""


class ChildProcess:
    def __init__(
        self,
        spec: ChildSpec,
        generation: int,
        prefix: str,
        on_exit: Callable[[ChildProcess], None],
        doorbell_dir: str = "",
    ) -> None:
        self.spec = spec
        self.generation = generation
        self.run_dir = run_directory_of(prefix)
        tag = f"{spec.name}.{generation}"
        self.control_spec = RingSpec(f"{prefix}c.{tag}", CONTROL_RING_BYTES, 1, doorbell_dir)
        self.status_spec = RingSpec(f"{prefix}s.{tag}", CONTROL_RING_BYTES, 1, doorbell_dir)
        create_ring(self.control_spec)
        create_ring(self.status_spec)
        self._control = RingWriter(self.control_spec)
        self._status = RingReader(self.status_spec)
        self._on_exit = on_exit
        self._loop = asyncio.get_running_loop()
        self.ready: asyncio.Future[Ready] = self._loop.create_future()
        self.exited: asyncio.Future[int] = self._loop.create_future()
        self.dying = False  # its sentinel fired: it is dead, perhaps not yet reaped (`exited`)
        self.last_seen = (
            time.monotonic()
        )  # of the last status frame: the heartbeat watchdog's input
        self.last_beat: Heartbeat | None = None  # the liveness watchdog's other input
        self.decode_errors = 0
        self.frames_sent: dict[str, int] = {}  # as of its last heartbeat, by ring
        self.bytes_sent: dict[str, int] = {}
        self.ring_fill: dict[str, float] = {}  # as of its last heartbeat, by outbound ring
        self.died_at: float | None = None  # monotonic: when its death was seen
        self.exit_reason = ""  # the child's own last word (Exiting), or why we killed it
        self.stopping = False  # the supervisor asked it to go: its exit is not a failure
        self._process: multiprocessing.process.BaseProcess | None = None
        self._pid: int | None = None  # kept: the process object forgets it once closed
        self._killed = False
        self._swap_ids = itertools.count()
        self._swaps: dict[int, asyncio.Future[None]] = {}  # SwapRings sent, SwapDone awaited
        self._released = False
        self._status_task: asyncio.Task[None] | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def alive(self) -> bool:
        return self._process is not None and not self.exited.done()

    def start(
        self,
        inbound: Mapping[str, InboundRing],
        outbound: Mapping[str, RingSpec],
        log_level: str,
        segments: Mapping[str, str] | None = None,
        spare: Spare | None = None,
    ) -> None:
        """Spawn the child, or hand its boot to `spare` (a process already started for its
        entry, engine/runtime/spares.py) when that one can take it."""
        boot = ChildBoot(
            name=self.name,
            entry=self.spec.entry,
            config=self.spec.config,
            root_pid=os.getpid(),
            generation=self.generation,
            control=self.control_spec,
            status=self.status_spec,
            inbound=dict(inbound),
            outbound=dict(outbound),
            heartbeat_interval=self.spec.heartbeat_interval,
            log_level=log_level,
            segments=dict(segments or {}),
            run_dir=self.run_dir,
        )
        frame = BOOT.encode(boot)
        process = spare.hand_over(frame) if spare is not None else None
        how = "in a spare process" if process is not None else "as a new process"
        if process is None:
            # daemon: should the root exit without an orderly shutdown, multiprocessing's exit
            # hook SIGTERMs the children instead of joining them forever. (A daemonic process
            # may not start multiprocessing children of its own; actors have no need to.)
            process = _SPAWN.Process(target=child_main, args=(frame,), name=self.name, daemon=True)
            process.start()
        self._process = process
        self._pid = process.pid
        self._loop.add_reader(process.sentinel, self._on_sentinel)
        self._status_task = self._loop.create_task(self._read_status())
        log.info("started %s (generation %d) %s, pid %s", self.name, self.generation, how, self.pid)

    async def wait_ready(self) -> Ready:
        """The child's Ready message; ChildStartError naming the child if it dies or times out."""
        timeout = self.spec.ready_timeout
        await asyncio.wait(
            (self.ready, self.exited), timeout=timeout, return_when="FIRST_COMPLETED"
        )
        if self.ready.done():
            return self.ready.result()
        if self.exited.done():
            raise ChildStartError(f"child {self.name!r} {self.describe_exit()} before it was ready")
        raise ChildStartError(
            f"child {self.name!r} sent no Ready within its ready_timeout of {timeout:g} s"
        )

    def send_control(self, message: ControlMessage) -> bool:
        """Queue a control message without waiting; False if the child is not reading (full)."""
        return self._control.try_send_many([CONTROL.encode(message)]) == 1

    async def swap_rings(
        self, peer: str, inbound: Mapping[str, InboundRing], outbound: Mapping[str, RingSpec]
    ) -> bool:
        """Hand the child fresh rings and wait until it confirms; False if it did not in time.

        It gets stall_timeout to answer: an actor whose event loop cannot serve its control
        ring that long would be declared hung anyway.
        """
        swap_id = next(self._swap_ids)
        done = self._swaps[swap_id] = self._loop.create_future()
        try:
            if not self.send_control(SwapRings(swap_id, peer, dict(inbound), dict(outbound))):
                return False
            timeout = self.spec.stall_timeout
            await asyncio.wait((done, self.exited), timeout=timeout, return_when="FIRST_COMPLETED")
            return done.done() or self.exited.done()  # a dead child gets new rings at restart
        finally:
            del self._swaps[swap_id]

    def kill(self, reason: str) -> None:
        """SIGKILL, once; `reason` becomes the reason its exit is reported with."""
        if self.alive and not self._killed and self._process is not None:
            log.warning("killing %s (pid %s): %s", self.name, self.pid, reason)
            self._killed = True
            self.exit_reason = reason
            self._process.kill()

    def read_status(self) -> None:
        """Take in status frames already waiting, e.g. before judging the heartbeat."""
        self._handle_status(self._status.drain())

    async def stop(self, reason: str) -> int:
        """Stop message, SIGTERM, SIGKILL, each after shutdown_timeout; the exit status."""
        self.stopping = True
        process = self._process
        if process is None:
            return 0
        steps: list[tuple[str, Callable[[], object]]] = [
            ("Stop message", lambda: self.send_control(Stop(reason))),
            ("SIGTERM", process.terminate),
            ("SIGKILL", process.kill),
        ]
        for step, (what, act) in enumerate(steps):
            if self.exited.done():
                break
            if step > 0:
                log.warning("%s (pid %s) still running: sending %s", self.name, self.pid, what)
            act()
            timeout = _KILL_WAIT if what == "SIGKILL" else self.spec.shutdown_timeout
            await asyncio.wait((self.exited,), timeout=timeout)
        if not self.exited.done():
            log.error("%s (pid %s) survived SIGKILL for %g s", self.name, self.pid, _KILL_WAIT)
            return -signal.SIGKILL
        return self.exited.result()

    def describe_exit(self) -> str:
        if not self.exited.done():
            return "is running"
        code = self.exited.result()
        if code < 0:
            text = f"was killed by {signal.Signals(-code).name}"
        else:
            text = f"exited with status {code}"
        return f"{text} ({self.exit_reason})" if self.exit_reason else text

    async def release(self) -> None:
        """Close and unlink this generation's control rings (after the process has exited)."""
        if self._released:
            return
        self._released = True
        if self._status_task is not None:
            self._status_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._status_task
        self._control.close()
        self._status.close()
        destroy_ring(self.control_spec)
        destroy_ring(self.status_spec)
        if self._process is not None and self.exited.done():
            self._process.close()

    async def _read_status(self) -> None:
        while True:
            self._handle_status(await self._status.recv_many())

    def _handle_status(self, frames: list[bytes]) -> None:
        if frames:
            self.last_seen = time.monotonic()
        for message in STATUS.decode_many(frames):
            if isinstance(message, Ready):
                if not self.ready.done():
                    self.ready.set_result(message)
            elif isinstance(message, Heartbeat):
                self.last_beat = message
                self.decode_errors = message.decode_errors
                self.frames_sent, self.bytes_sent = message.frames_sent, message.bytes_sent
                self.ring_fill = message.ring_fill
            elif isinstance(message, SwapDone):
                done = self._swaps.get(message.swap_id)
                if done is not None and not done.done():
                    done.set_result(None)
            elif isinstance(message, Exiting) and not self.exit_reason:
                self.exit_reason = message.reason

    def _on_sentinel(self) -> None:
        assert self._process is not None
        self._loop.remove_reader(self._process.sentinel)
        self.dying = True
        self.died_at = time.monotonic()
        self._reap()

    def _reap(self) -> None:
        assert self._process is not None
        code = self._process.exitcode
        if code is None:
            # The sentinel pipe closes a moment before the kernel lets the parent reap the
            # child; look again shortly.
            self._loop.call_later(0.002, self._reap)
            return
        if not self._released:
            self.read_status()  # its last words (Exiting) may be unread
        self.exited.set_result(code)
        log.log(
            logging.INFO if self.stopping else logging.WARNING,
            "%s (pid %s) %s",
            self.name,
            self.pid,
            self.describe_exit(),
        )
        self._on_exit(self)


async def outcome(awaitable: Awaitable[None]) -> BaseException | None:
    """The exception `awaitable` raised, if any (as gather(return_exceptions=True) gives it)."""
    try:
        await awaitable
    except Exception as exc:
        return exc
    return None
