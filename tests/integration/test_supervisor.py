"""The supervisor with real child processes: restarts, strategies, intensity, hangs, shutdown."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from engine.runtime.child_spec import RingDecl, Strategy
from engine.runtime.doorbell import default_doorbell_dir
from engine.runtime.events import (
    ChildDied,
    ChildReady,
    ChildRestarted,
    Escalated,
    RingsSwapped,
)
from engine.runtime.ring import sweep_stale_segments
from engine.runtime.stopped import STOPPED_FROM_OUTSIDE
from engine.runtime.supervisor import ChildStartError, Supervisor
from tests.integration.sample_actors import (
    EVENT_TIMEOUT,
    NOTES,
    Note,
    async_wait_until,
    child,
    echo_config,
    echo_rings,
    pid_running,
    supervised,
    supervisor_spec,
    wait_until,
)

REPO = Path(__file__).resolve().parents[2]


def chain_rings() -> tuple[RingDecl, ...]:
    """root -in-> first -mid-> second -out-> root"""
    return (
        RingDecl(name="in", writer="root", readers=("first",), capacity=4096),
        RingDecl(name="mid", writer="first", readers=("second",), capacity=4096),
        RingDecl(name="out", writer="second", readers=("root",), capacity=4096),
    )


async def test_a_crashed_child_is_restarted_with_fresh_rings_and_serves_again() -> None:
    spec = supervisor_spec(child("first"), child("second"), rings=chain_rings())
    async with supervised(spec) as run:
        assert await run.roundtrip("hello") == "second:first:hello"
        first_pid, second_pid = run.pid("first"), run.pid("second")
        old_out = run.supervisor.root.reader("out").spec.name

        assert await run.supervisor.root.send_many("in", [NOTES.encode(Note("crash second"))])
        died = await run.next(ChildDied, "second")
        restarted = await run.next(ChildRestarted, "second")

        assert died.exitcode == 1 and "asked to crash" in died.reason
        assert restarted.pid != second_pid and restarted.restarts == 1
        assert run.pid("first") == first_pid  # one_for_one: its peer only swapped rings
        assert run.supervisor.root.reader("out").spec.name != old_out
        assert "asked to crash" in run.row("second").last_restart_reason
        # Its downtime, death seen to new generation ready, is /metrics' recovery time; its
        # peer only swapped rings and was never down.
        assert 0.0 < run.row("second").recovery_seconds < EVENT_TIMEOUT
        assert run.row("first").recovery_seconds == 0.0
        assert await run.roundtrip("again") == "second:first:again"
        assert not pid_running(second_pid)


async def test_children_that_die_together_restart_together_and_serve_again() -> None:
    spec = supervisor_spec(child("first"), child("second"), rings=chain_rings())
    async with supervised(spec) as run:
        assert await run.roundtrip("hello") == "second:first:hello"
        pids = {name: run.pid(name) for name in ("first", "second")}
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        # Blocking the loop until both are dead: both deaths are queued before the supervisor
        # handles either.
        for name, pid in pids.items():
            wait_until(lambda pid=pid: not pid_running(pid), EVENT_TIMEOUT, f"{name} to die")  # type: ignore[misc]
        restarted = [await run.next(ChildRestarted) for _ in range(2)]

        assert sorted(event.name for event in restarted) == ["first", "second"]
        for event in restarted:  # one restart for both: each names both deaths as its reason
            assert event.restarts == 1
            assert "first was killed by SIGKILL" in event.reason
            assert "second was killed by SIGKILL" in event.reason
        assert await run.roundtrip("again") == "second:first:again"


async def test_a_group_member_crash_restarts_the_whole_group() -> None:
    spec = supervisor_spec(child("rank0", group="tp"), child("rank1", group="tp"), child("other"))
    async with supervised(spec) as run:
        before = {name: run.pid(name) for name in ("rank0", "rank1", "other")}

        os.kill(before["rank1"], signal.SIGKILL)
        restarted = {(await run.next(ChildRestarted)).name for _ in range(2)}

        assert restarted == {"rank0", "rank1"}
        assert run.pid("other") == before["other"] and run.row("other").restarts == 0
        assert run.pid("rank0") != before["rank0"] and run.pid("rank1") != before["rank1"]
        assert not pid_running(before["rank0"]) and not pid_running(before["rank1"])


async def test_rest_for_one_restarts_the_failed_child_and_those_started_after_it() -> None:
    spec = supervisor_spec(child("a"), child("b"), child("c"), strategy=Strategy.REST_FOR_ONE)
    async with supervised(spec) as run:
        before = {name: run.pid(name) for name in "abc"}

        os.kill(before["b"], signal.SIGKILL)
        restarted = [(await run.next(ChildRestarted)).name for _ in range(2)]

        assert restarted == ["b", "c"]  # in start order
        assert run.pid("a") == before["a"] and run.row("a").restarts == 0
        assert run.pid("c") != before["c"]


async def test_past_the_restart_intensity_everything_stops_in_order_with_the_reason(
    tmp_path: Path,
) -> None:
    stop_log = tmp_path / "stops"
    spec = supervisor_spec(
        child("a", config=echo_config(stop_log=str(stop_log))),
        child("crasher", config=echo_config(exit_after_ready=0.2)),
        child("c", config=echo_config(stop_log=str(stop_log))),
        max_restarts=2,
    )
    async with supervised(spec) as run:
        escalated = await run.next(Escalated)
        reason = await asyncio.wait_for(run.supervisor.wait_closed(), EVENT_TIMEOUT)

        assert "restart intensity" in escalated.reason and "crasher" in escalated.reason
        assert "exited with status 3" in escalated.reason
        assert reason == f"escalated: {escalated.reason}"
        assert stop_log.read_text().split() == ["c", "a"]  # reverse start order
        assert all(row.pid is None for row in run.supervisor.status())


async def test_a_stopped_child_is_found_by_its_process_state_not_its_heartbeat_timeout() -> None:
    """SIGSTOP stopped every stream for the whole heartbeat timeout (10 s by default)."""
    spec = supervisor_spec(child("echo", heartbeat_timeout=600.0), rings=echo_rings())
    async with supervised(spec) as run:
        hung = run.pid("echo")

        os.kill(hung, signal.SIGSTOP)
        died = await run.next(ChildDied, "echo")  # within EVENT_TIMEOUT, far below 600 s
        await run.next(ChildRestarted, "echo")

        assert died.exitcode == -signal.SIGKILL and STOPPED_FROM_OUTSIDE in died.reason
        assert "process state is T" in died.reason
        assert not pid_running(hung)
        assert await run.roundtrip("awake") == "echo:awake"


async def test_a_child_silent_while_it_computes_is_not_taken_for_a_hang() -> None:
    """A native call holding the GIL keeps the heartbeat thread out: a restarted tokenizer
    building its tokenizer at load 34 went 2 s without a heartbeat and was killed, again and
    again. Silent but using CPU, a child is given stall_timeout."""
    timeouts = {"heartbeat_interval": 0.1, "heartbeat_timeout": 0.5, "stall_timeout": 120.0}
    spec = supervisor_spec(child("echo", **timeouts), rings=echo_rings())
    async with supervised(spec) as run:
        first = run.pid("echo")
        assert await run.roundtrip("gil 60000000") == "echo:gil 60000000"
        assert run.pid("echo") == first


async def test_a_step_is_judged_by_its_own_deadline_and_a_stuck_loop_by_the_stall_timeout() -> None:
    timeouts = {"heartbeat_timeout": 1.0, "stall_timeout": 1.0}
    spec = supervisor_spec(child("echo", **timeouts), rings=echo_rings())
    async with supervised(spec) as run:
        first = run.pid("echo")
        # Longer than both timeouts, within its own deadline: no hang.
        assert await run.roundtrip("step 2.5 30") == "echo:step 2.5 30"
        assert run.pid("echo") == first

        await run.send("step 600 1.5")  # past its deadline: hung
        died = await run.next(ChildDied, "echo")
        assert "past its deadline of 1.5 s" in died.reason
        await run.next(ChildRestarted, "echo")

        await run.send("block 600")  # the event loop held, outside any step: hung
        died = await run.next(ChildDied, "echo")
        assert "event loop has not turned" in died.reason and "stall_timeout is 1 s" in died.reason
        await run.next(ChildRestarted, "echo")
        assert await run.roundtrip("awake") == "echo:awake"


async def test_a_child_that_never_gets_ready_fails_start_up_with_an_error_naming_it(
    tmp_path: Path,
) -> None:
    stop_log, pid_file = tmp_path / "stops", tmp_path / "sleepy.pid"
    spec = supervisor_spec(
        child("a", config=echo_config(stop_log=str(stop_log))),
        child(
            "sleepy",
            ready_timeout=1.0,
            config=echo_config(never_ready=True, pid_file=str(pid_file)),
        ),
    )
    supervisor = Supervisor(spec)
    events = supervisor.subscribe()

    with pytest.raises(ChildStartError, match=r"child 'sleepy' sent no Ready within .*1 s"):
        await supervisor.start()

    ready = await asyncio.wait_for(events.get(), EVENT_TIMEOUT)
    assert isinstance(ready, ChildReady) and ready.name == "a"
    assert stop_log.read_text().split() == ["a"]  # the started child was stopped in order
    assert not pid_running(ready.pid)
    assert not pid_running(int(pid_file.read_text()))
    assert "start-up failed" in await supervisor.wait_closed()


async def test_a_consumers_death_is_reported_and_frees_a_producer_waiting_on_it() -> None:
    rings = (RingDecl(name="in", writer="root", readers=("consumer",), capacity=4096),)
    spec = supervisor_spec(child("consumer", config=echo_config(stall_reading=True)), rings=rings)
    async with supervised(spec) as run:
        root = run.supervisor.root
        frame = NOTES.encode(Note("x" * 1000))
        sending = asyncio.ensure_future(root.send_many("in", [frame] * 20))  # more than fits
        await async_wait_until(
            lambda: root.writer("in").free_bytes() < len(frame), EVENT_TIMEOUT, "a full ring"
        )
        consumer = run.pid("consumer")

        os.kill(consumer, signal.SIGKILL)
        died = await run.next(ChildDied, "consumer")
        swapped = await run.next(RingsSwapped)

        assert died.exitcode == -signal.SIGKILL and died.pid == consumer
        assert swapped.peer == "consumer" and swapped.rings == ["in"]
        assert await asyncio.wait_for(sending, EVENT_TIMEOUT) is False  # gave up, not hung
        await run.next(ChildRestarted, "consumer")


async def test_a_child_that_will_not_stop_gets_sigterm_and_then_sigkill(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="engine.runtime.child_process")
    spec = supervisor_spec(
        child("stubborn", shutdown_timeout=0.3, config=echo_config(hang_on_stop=True))
    )
    async with supervised(spec) as run:
        stubborn = run.pid("stubborn")

    steps = [
        record.getMessage()
        for record in caplog.records
        if record.name == "engine.runtime.child_process"
    ][-3:]
    assert "still running: sending SIGTERM" in steps[0]
    assert "still running: sending SIGKILL" in steps[1]
    assert f"stubborn (pid {stubborn}) was killed by SIGKILL" in steps[2]
    assert not pid_running(stubborn)


def test_killing_the_root_leaves_no_child_running_and_the_next_start_sweeps(
    tmp_path: Path,
) -> None:
    info_path = tmp_path / "root.json"
    root = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.sample_actors", str(info_path)], cwd=REPO
    )
    try:
        wait_until(info_path.exists, EVENT_TIMEOUT, "the root to start its children")
        info = msgspec.json.decode(info_path.read_bytes())
        assert info["spares"] and all(pid_running(pid) for pid in info["spares"])
        info["children"] += info["spares"]  # a spare must die with its root as a child does
        assert all(pid_running(pid) for pid in info["children"])
        prefix = f"engine-{info['root']}-"
        assert any(name.startswith(prefix) for name in os.listdir("/dev/shm"))
    finally:
        root.kill()
        root.wait(EVENT_TIMEOUT)

    wait_until(
        lambda: not any(pid_running(pid) for pid in info["children"]),
        EVENT_TIMEOUT,
        f"children {info['children']} to die with their root",
    )
    swept = sweep_stale_segments()
    assert [name for name in swept if name.startswith(prefix)]
    left = [*os.listdir("/dev/shm"), *os.listdir(default_doorbell_dir())]
    assert not [name for name in left if name.startswith(prefix)]
