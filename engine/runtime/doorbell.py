"""Waiting on rings without burning CPU: adaptive spin, then park on a doorbell.

A doorbell is a named FIFO in an owner-only directory. Both ends of a ring open it by name with
O_RDWR | O_NONBLOCK (Linux lets a FIFO be opened read-write, so `open` never blocks waiting for
the other side), which is all a `spawn`ed process needs: it gets only the ring's name, and a
restarted process simply opens the FIFO again. An eventfd would be cheaper but cannot be opened
by name; a Unix socket would need a listener. Ringing writes one byte; the parked side's fd
becomes readable, which `loop.add_reader` turns into a wake-up.

The lost-wakeup race. The waiter stores "I am parked" and then loads the ring position; the other
side stores the new position and then loads "is it parked?". On x86 a store may be reordered
after a later load (store buffering), so both sides could read stale values: the waiter sees no
data and sleeps, the other side sees nobody parked and does not ring. A full fence between the
store and the load on both sides forbids that outcome; CPython offers no fence, but acquiring
and releasing a `threading.Lock` runs locked atomic instructions (a full barrier on x86) inside
glibc's semaphore code. As a second line of defence every park re-checks after
`SAFETY_RECHECK_S` even without a ring, so a missed doorbell can never hang anything; a wait that
goes on re-checks less and less often (doubling up to `MAX_SAFETY_RECHECK_S`), so that an idle
engine's many parked waits do not wake it tens of times a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Protocol

from engine.runtime.private_files import open_private, taken

SAFETY_RECHECK_S = 0.1
MAX_SAFETY_RECHECK_S = 1.6
# Readers: a peer's reply usually comes while they spin, sooner than parking and being woken.
DEFAULT_MAX_SPIN_US = 200.0
# A writer facing a full ring waits for its reader to get through a whole ring's worth of frames,
# far longer than a reply takes; spinning through that only takes CPU from the reader on a busy
# machine.
DEFAULT_WRITER_MAX_SPIN_US = 20.0
_PIPE_DRAIN_BYTES = 4096

_fence_lock = threading.Lock()


def full_fence() -> None:
    """A full memory barrier (see the module docstring for why a lock gives one)."""
    _fence_lock.acquire()
    _fence_lock.release()


class Parkable(Protocol):
    """One thing a waiter can wait for: readiness check, parked flag, doorbell to listen on."""

    @property
    def doorbell_fd(self) -> int: ...

    def ready(self) -> bool: ...

    def set_parked(self, parked: bool) -> None: ...


# -- doorbell files --------------------------------------------------------------------------


def default_doorbell_dir() -> str:
    """Where doorbells live when a RingSpec names no directory: per user, under the temp dir."""
    return os.path.join(tempfile.gettempdir(), f"engine-doorbells-{os.getuid()}")


def resolve_doorbell_dir(doorbell_dir: str) -> str:
    return doorbell_dir or default_doorbell_dir()


def doorbell_path(doorbell_dir: str, ring_name: str, role: str) -> str:
    """The FIFO of one waiting party of a ring: role "w" (writer) or "r<index>" (a reader).
    The doorbell directory is already the user's own: a ring's run directory is flattened into
    the file's name."""
    flat = ring_name.replace("/", "-")
    return os.path.join(resolve_doorbell_dir(doorbell_dir), f"{flat}.{role}.bell")


def create_doorbell(path: str) -> None:
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:
        raise taken(path) from None


def open_doorbell(path: str) -> int:
    try:
        return open_private(path, os.O_RDWR | os.O_NONBLOCK, kind=stat.S_IFIFO)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"doorbell {path!r} does not exist: was the ring created (create_ring) and not yet "
            "destroyed?"
        ) from None


def unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def ring_doorbell(fd: int) -> None:
    # A full FIFO holds rings nobody has read yet: the party is certainly woken already.
    with contextlib.suppress(BlockingIOError):
        os.write(fd, b"\x01")


def clear_doorbell(fd: int) -> None:
    try:
        while len(os.read(fd, _PIPE_DRAIN_BYTES)) == _PIPE_DRAIN_BYTES:
            pass
    except BlockingIOError:
        pass


# -- waiting ---------------------------------------------------------------------------------


class AdaptiveSpin:
    """How long to spin before parking, learned from how long recent waits lasted.

    A wait that ended within `max_spin_us` would have been (or was) caught by spinning, so the
    budget grows back towards the maximum; a longer wait means spinning only burns CPU, so the
    budget halves and soon reaches zero: an idle party parks at once.
    """

    def __init__(self, max_spin_us: float = DEFAULT_MAX_SPIN_US) -> None:
        if not 0 <= max_spin_us <= 1_000_000:
            raise ValueError(f"max_spin_us must be between 0 and 1e6 µs, got {max_spin_us!r}")
        self.max_ns = int(max_spin_us * 1000)
        self.budget_ns = self.max_ns

    def record_wait(self, waited_ns: int) -> None:
        if waited_ns <= self.max_ns:
            grown = max(2 * self.budget_ns, 2 * waited_ns, self.max_ns // 16)
            self.budget_ns = min(self.max_ns, grown)
        else:
            self.budget_ns = 0 if self.budget_ns < self.max_ns // 64 else self.budget_ns // 2


class _Parking:
    """One async park on several doorbells: registered with the loop, undone exactly once."""

    def __init__(self, loop: asyncio.AbstractEventLoop, parties: Sequence[Parkable]) -> None:
        self._loop = loop
        self._parties = parties
        self._fds: list[int] = []
        self._woken: asyncio.Future[None] = loop.create_future()
        self._timer: asyncio.TimerHandle | None = None
        self.released = False
        self.interrupted = False
        for party in parties:
            party.set_parked(True)

    def listen(self, timeout: float) -> None:
        for party in self._parties:
            fd = party.doorbell_fd
            self._loop.add_reader(fd, self._on_bell, fd)
            self._fds.append(fd)
        self._timer = self._loop.call_later(timeout, self._wake)

    async def sleep(self) -> None:
        await self._woken

    def _on_bell(self, fd: int) -> None:
        clear_doorbell(fd)  # level-triggered: empty the FIFO or the loop keeps calling us
        self._wake()

    def _wake(self) -> None:
        if not self._woken.done():
            self._woken.set_result(None)

    def release(self) -> None:
        """Stop listening and lower the parked flags; safe to call twice."""
        if self.released:
            return
        self.released = True
        for fd in self._fds:
            self._loop.remove_reader(fd)
        if self._timer is not None:
            self._timer.cancel()
        for party in self._parties:
            party.set_parked(False)
        self._wake()

    def interrupt(self) -> None:
        """Release now and tell the sleeper to return without touching its parties again."""
        self.interrupted = True
        self.release()


class Waiter:
    """Waits until any of some parties is ready: spin first (adaptive budget), then park.

    Spinning yields to the event loop every round, so the loop's other coroutines keep running,
    and calls sched_yield, so a process we wait for that shares our core gets it at once: on an
    oversubscribed machine it would otherwise run only when the kernel preempts the spinner at
    the end of its time slice, and the round trip would take that long. (The price: while that
    other process runs, this loop pauses, as it would when the kernel preempts a busy spinner.)

    Several coroutines may wait at once (parties count their parkers). `interrupt()` ends every
    wait in progress at once; the waits return without touching their parties again, so the
    owner may close them right after (a mailbox swapping a ring, a writer being closed).
    """

    def __init__(self, max_spin_us: float = DEFAULT_MAX_SPIN_US) -> None:
        self.spin = AdaptiveSpin(max_spin_us)
        self._parkings: set[_Parking] = set()
        self._interrupts = 0

    def interrupt(self) -> None:
        self._interrupts += 1
        for parking in list(self._parkings):
            parking.interrupt()
        self._parkings.clear()

    async def wait(self, parties: Sequence[Parkable]) -> None:
        """Return once a party is ready or the wait was interrupted (the caller re-checks)."""
        interrupts = self._interrupts
        started = time.perf_counter_ns()
        spin_until = started + self.spin.budget_ns
        while True:  # spin, yielding to the loop each round so other coroutines run
            if any(party.ready() for party in parties):
                self.spin.record_wait(time.perf_counter_ns() - started)
                return
            if time.perf_counter_ns() >= spin_until:
                break
            await asyncio.sleep(0)  # let this loop's other coroutines run
            os.sched_yield()  # and other processes on this core: maybe the one we wait for
            if self._interrupts != interrupts:
                return
        loop = asyncio.get_running_loop()
        recheck = SAFETY_RECHECK_S
        while True:
            parking = _Parking(loop, parties)
            self._parkings.add(parking)
            try:
                full_fence()  # parked flags stored before the positions are loaded
                if any(party.ready() for party in parties):
                    break
                parking.listen(recheck)
                await parking.sleep()
                recheck = min(recheck * 2, MAX_SAFETY_RECHECK_S)
            finally:
                self._parkings.discard(parking)
                parking.release()
            if parking.interrupted or self._interrupts != interrupts:
                return
            if any(party.ready() for party in parties):
                break
        self.spin.record_wait(time.perf_counter_ns() - started)
