"""Spare processes (engine/runtime/spares.py), seen from outside: through /proc and the
pids the restarted children run as."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

from engine.runtime.events import ChildRestarted
from tests.integration.sample_actors import (
    ECHO,
    EVENT_TIMEOUT,
    Run,
    async_wait_until,
    child,
    echo_rings,
    pid_running,
    supervised,
    supervisor_spec,
)


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name: [0] state, [1] ppid, [11:13] CPU."""
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()


def _cpu_ticks(pid: int) -> int:
    fields = _stat(pid)
    return int(fields[11]) + int(fields[12])  # utime + stime


async def _first_spare(run: Run) -> int:
    await async_wait_until(lambda: run.supervisor.spare_pids().get(ECHO), EVENT_TIMEOUT, "a spare")
    pid = run.supervisor.spare_pids()[ECHO]
    assert pid is not None
    return pid


def _parked(pid: int) -> bool:
    """Blocked in a read of its pipe, its preload thread done."""
    threads = Path(f"/proc/{pid}/status").read_text().split("Threads:")[1].split()[0]
    return "pipe_read" in Path(f"/proc/{pid}/wchan").read_text() and threads == "1"


async def test_a_restart_runs_in_the_parked_spare_and_a_new_spare_replaces_it() -> None:
    spec = supervisor_spec(child("echo"), rings=echo_rings(), spares=True)
    async with supervised(spec) as run:
        spare = await _first_spare(run)  # started once the run is quiet
        assert _stat(spare)[1] == str(os.getpid())  # a child of the root
        await async_wait_until(lambda: _parked(spare), EVENT_TIMEOUT, "the spare to park")
        ticks = _cpu_ticks(spare)
        await asyncio.sleep(1.0)
        assert _stat(spare)[0] == "S" and _cpu_ticks(spare) - ticks <= 1  # no polling

        os.kill(run.pid("echo"), signal.SIGKILL)
        restarted = await run.next(ChildRestarted, "echo")
        assert restarted.pid == spare  # the spare became the child
        assert await run.roundtrip("after") == "echo:after"
        await async_wait_until(
            lambda: run.supervisor.spare_pids().get(ECHO) not in (None, spare),
            EVENT_TIMEOUT,
            "a new spare",
        )
        second_spare = run.supervisor.spare_pids()[ECHO]

        # Back to back, the new spare perhaps still importing: the boot waits in its pipe.
        os.kill(run.pid("echo"), signal.SIGKILL)
        again = await run.next(ChildRestarted, "echo")
        assert again.pid == second_spare
        assert await run.roundtrip("again") == "echo:again"
        await async_wait_until(
            lambda: run.supervisor.spare_pids().get(ECHO) not in (None, second_spare),
            EVENT_TIMEOUT,
            "a third spare",
        )
        last_spare = run.supervisor.spare_pids()[ECHO]
    assert last_spare is not None and not pid_running(last_spare)  # shut down with the rest
