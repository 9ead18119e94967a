"""When a running child counts as hung, from what the root can see without its help.

Four signs, each from something the child's work cannot hold up or fake:

- its process state in /proc: a process stopped by a signal (SIGSTOP, a debugger) is `T` or `t`
  at once, and one seen stopped for `stopped_timeout` (two watchdog ticks or more) is hung;
- its heartbeats, sent from a thread that a step (native code without the GIL, or work on
  another thread) never blocks: none for `heartbeat_timeout` while the process uses no CPU
  means it is stuck as a whole (waiting on something that will not come); one that goes on
  computing (a native call that holds the GIL, such as building a large tokenizer, keeps the
  heartbeat thread out) is given up to `stall_timeout`;
- a step past its deadline: the worker gives each step one derived from the step's size and
  the rate measured on earlier steps (engine/runtime/work_rate.py), and its beats carry how long
  the step has run, so a step of several seconds is judged by its own size, never by a fixed
  timeout;
- the event loop outside such a step: a loop that has not turned for `stall_timeout`.

A pure function of those observations, so that each rule is tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.messages.control import Heartbeat
from engine.runtime.stopped import STOPPED_FROM_OUTSIDE

# CPU time a silent process must have used since it was last heard from to count as computing:
# one clock tick, as a busy process on a loaded machine may get a small share of a core, and a
# stuck one (waiting on a lock, a peer, the disk) gets none.
MIN_PROGRESS_S = 0.01


@dataclass(frozen=True)
class Observed:
    """What the watchdog knows of one running child at one tick."""

    now: float  # monotonic
    last_seen: float  # when its last status frame was read
    beat: Heartbeat | None  # its last heartbeat, if any yet
    stopped_since: float | None  # when its process was first seen stopped, if it is now
    cpu_since_seen: float | None = None  # CPU seconds it used since last_seen; None: unknown


@dataclass(frozen=True)
class Timeouts:
    """A child's liveness timeouts, in seconds (its ChildSpec's)."""

    heartbeat: float
    stall: float
    stopped: float


def why_hung(seen: Observed, timeouts: Timeouts) -> str | None:
    """Why the child counts as hung now, in words for its death's reason; None if it does not."""
    if seen.stopped_since is not None and seen.now - seen.stopped_since >= timeouts.stopped:
        stopped_for = seen.now - seen.stopped_since
        return f"{STOPPED_FROM_OUTSIDE} (its process state is T for {stopped_for:.1f} s)"
    heartbeat_timeout, stall_timeout = timeouts.heartbeat, timeouts.stall
    silent = seen.now - seen.last_seen
    computing = seen.cpu_since_seen is not None and seen.cpu_since_seen >= MIN_PROGRESS_S
    if silent > heartbeat_timeout and not computing:
        return (
            f"no heartbeat for {silent:.1f} s and no CPU time used meanwhile, heartbeat_timeout "
            f"is {heartbeat_timeout:g} s"
        )
    if silent > stall_timeout:
        return (
            f"no heartbeat for {silent:.1f} s while computing, stall_timeout is {stall_timeout:g} s"
        )
    beat = seen.beat
    if beat is None:
        return None
    if beat.busy_limit and beat.busy_for > beat.busy_limit:
        return (
            f"a step running for {beat.busy_for:.1f} s, past its deadline of "
            f"{beat.busy_limit:.1f} s (from the step's size and the rate measured before)"
        )
    if not beat.busy_for and beat.loop_lag > stall_timeout:
        return (
            f"its event loop has not turned for {beat.loop_lag:.1f} s, stall_timeout is "
            f"{stall_timeout:g} s"
        )
    return None
