"""When the root counts a child as hung (engine/runtime/liveness.py), and the deadline a model
step gets from its size (engine/runtime/work_rate.py): a stopped process at once, a silent one
after the heartbeat timeout, a step past its own deadline, a loop stuck outside a step; never a
long step within its deadline, however long."""

from __future__ import annotations

import pytest

from engine.messages.control import Heartbeat
from engine.runtime.liveness import Observed, Timeouts, why_hung
from engine.runtime.stopped import STOPPED_FROM_OUTSIDE
from engine.runtime.work_rate import WorkRate

TIMEOUTS = Timeouts(heartbeat=2.0, stall=10.0, stopped=0.5)


def judged(
    beat: Heartbeat | None = None,
    silent: float = 0.1,
    stopped_for: float | None = None,
    cpu: float | None = 0.0,
) -> str | None:
    """`cpu`: CPU seconds the process used while silent."""
    now = 1000.0
    stopped_since = None if stopped_for is None else now - stopped_for
    seen = Observed(now, now - silent, beat, stopped_since, cpu)
    return why_hung(seen, TIMEOUTS)


def beat(loop_lag: float = 0.0, busy_for: float = 0.0, busy_limit: float = 0.0) -> Heartbeat:
    return Heartbeat(1, 0, loop_lag=loop_lag, busy_for=busy_for, busy_limit=busy_limit)


def test_a_stopped_process_is_hung_once_stopped_for_the_stopped_timeout() -> None:
    assert judged(beat(), stopped_for=0.0) is None  # one glimpse: not yet
    reason = judged(beat(), stopped_for=0.6)
    assert reason == f"{STOPPED_FROM_OUTSIDE} (its process state is T for 0.6 s)"


def test_silence_past_the_heartbeat_timeout_is_a_hang_unless_the_process_computes() -> None:
    assert judged(beat(), silent=1.9) is None
    reason = judged(beat(), silent=2.1)
    assert reason is not None and "no CPU time used meanwhile" in reason
    # A native call holding the GIL (a large tokenizer built): silent, but computing.
    assert judged(beat(), silent=9.0, cpu=1.5) is None
    reason = judged(beat(), silent=10.5, cpu=9.0)
    assert reason is not None and "while computing, stall_timeout is 10 s" in reason


def test_a_step_is_judged_by_its_deadline_alone() -> None:
    # A prefill chunk of minutes, its event loop idle or held, beats still coming: no hang.
    assert judged(beat(loop_lag=300.0, busy_for=299.0, busy_limit=400.0)) is None
    reason = judged(beat(busy_for=401.0, busy_limit=400.0))
    assert reason is not None and "past its deadline of 400.0 s" in reason


def test_an_event_loop_stuck_outside_a_step_is_a_hang() -> None:
    assert judged(beat(loop_lag=9.0)) is None
    reason = judged(beat(loop_lag=11.0))
    assert reason is not None and "stall_timeout is 10 s" in reason


def test_a_steps_deadline_grows_with_its_size_at_the_measured_rate() -> None:
    rate = WorkRate(floor=30.0, margin=8.0)
    assert rate.deadline(8192) == 0.0  # nothing measured yet: no deadline
    rate.observe(512, 2.0)  # a prefill chunk: ~3.9 ms a token
    rate.observe(16, 0.16)  # a decode step of 16 sequences: 10 ms a token, the slowest rate
    assert rate.deadline(16) == 30.0  # the floor
    assert rate.deadline(2048) == pytest.approx(8 * 2048 * 0.01)  # ~164 s; the chunk takes ~8 s
