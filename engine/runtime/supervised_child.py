"""What a supervisor keeps of each of its children between generations."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.runtime.child_process import ChildProcess
from engine.runtime.child_spec import ChildSpec
from engine.runtime.events import ChildStatus
from engine.runtime.liveness import Observed, Timeouts, why_hung
from engine.runtime.process_cpu import cpu_seconds
from engine.runtime.stopped import STOPPED_FROM_OUTSIDE, is_stopped


@dataclass
class SupervisedChild:
    spec: ChildSpec
    process: ChildProcess | None = None  # the current generation's, if any
    state: str = "stopped"
    spawned: int = 0  # generations started so far
    restarts: int = 0
    last_restart_reason: str = ""
    # Recovery: from its death seen (or its stop, for a sibling restarted with it) to its next
    # generation ready, summed over its restarts.
    down_since: float | None = None
    recovery_seconds: float = 0.0
    # Ring traffic of its earlier generations, by ring: with the current one's, a monotonic total
    frames_before: dict[str, int] = field(default_factory=dict)
    bytes_before: dict[str, int] = field(default_factory=dict)
    stopped_since: float | None = None  # monotonic: when its process was first seen stopped
    # (pid, its last_seen, its CPU seconds then): how much CPU it has used since it was last heard
    heard: tuple[int, float, float] | None = None

    def kill_if_hung(self, now: float) -> None:
        """A running child that counts as hung (engine/runtime/liveness.py) is killed, which
        makes the hang a death like any other. One stopped by a signal from outside (SIGSTOP)
        is named so: its death is no evidence against the requests it held."""
        process = self.process
        if self.state != "running" or process is None or not process.alive:
            self.stopped_since = None
            return
        process.read_status()  # what arrived while the watchdog was busy counts too
        stopped = process.pid is not None and is_stopped(process.pid)
        self.stopped_since = (self.stopped_since or now) if stopped else None
        seen = Observed(
            now,
            process.last_seen,
            process.last_beat,
            self.stopped_since,
            self._cpu_since_heard(process.pid, process.last_seen),
        )
        spec = self.spec
        timeouts = Timeouts(spec.heartbeat_timeout, spec.stall_timeout, spec.stopped_timeout)
        why = why_hung(seen, timeouts)
        if why is not None:
            if stopped and STOPPED_FROM_OUTSIDE not in why:
                why = f"{STOPPED_FROM_OUTSIDE}, {why}"
            self.stopped_since = None
            process.kill(why)

    def _cpu_since_heard(self, pid: int | None, last_seen: float) -> float | None:
        """CPU seconds the process used since its last status frame arrived (None: unknown)."""
        cpu = cpu_seconds(pid) if pid is not None else None
        if pid is None or cpu is None:
            return None
        heard = self.heard
        if heard is None or heard[:2] != (pid, last_seen):
            heard = self.heard = (pid, last_seen, cpu)
        return cpu - heard[2]

    def replace_process(self, process: ChildProcess) -> None:
        """A new generation: the old one's traffic (as of its last heartbeat) is kept."""
        old = self.process
        if old is not None:
            _add(self.frames_before, old.frames_sent)
            _add(self.bytes_before, old.bytes_sent)
        self.process = process

    def ring_traffic(self) -> tuple[dict[str, int], dict[str, int]]:
        """(frames, bytes) written by every generation so far, by ring."""
        frames, sent = dict(self.frames_before), dict(self.bytes_before)
        if self.process is not None:
            _add(frames, self.process.frames_sent)
            _add(sent, self.process.bytes_sent)
        return frames, sent

    def went_down(self) -> None:
        """It is about to be restarted: its downtime runs from its death, if it died."""
        died_at = self.process.died_at if self.process is not None else None
        self.down_since = died_at if died_at is not None else time.monotonic()

    def came_up(self) -> None:
        """Its new generation is ready: count the downtime as recovery."""
        if self.down_since is not None:
            self.recovery_seconds += time.monotonic() - self.down_since
            self.down_since = None

    def status(self) -> ChildStatus:
        process = self.process
        frames_sent, bytes_sent = self.ring_traffic()
        return ChildStatus(
            name=self.spec.name,
            entry=self.spec.entry,
            role=self.spec.role,
            group=self.spec.group,
            pid=process.pid if process is not None and process.alive else None,
            state=self.state,
            generation=process.generation if process is not None else 0,
            restarts=self.restarts,
            last_restart_reason=self.last_restart_reason,
            decode_errors=process.decode_errors if process is not None else 0,
            frames_sent=frames_sent,
            bytes_sent=bytes_sent,
            ring_fill=dict(process.ring_fill) if process is not None else {},
            recovery_seconds=self.recovery_seconds,
        )


def _add(total: dict[str, int], more: dict[str, int]) -> None:
    for ring, count in more.items():
        total[ring] = total.get(ring, 0) + count


REAP_WAIT_S = 1.0  # how long a death waits for a sibling that died with it to be reaped
# How long a death waits for the sentinels of siblings that died with it to be seen at all: the
# event loop may report one sentinel an iteration after another (seen in the full suite: two
# children SIGKILLed together were restarted one after the other).
SIBLING_SENTINEL_WAIT_S = 0.02


async def wait_for_dying_siblings(children: Iterable[SupervisedChild]) -> None:
    """Let the deaths that came with one be seen: a sibling that died too may not be reapable
    yet (its sentinel fires a moment before the kernel lets the parent reap it), and it belongs
    to the same failure."""
    await asyncio.sleep(SIBLING_SENTINEL_WAIT_S)
    unreaped = [
        child.process.exited
        for child in children
        if child.process is not None and child.process.dying and not child.process.exited.done()
    ]
    if unreaped:
        await asyncio.wait(unreaped, timeout=REAP_WAIT_S)
