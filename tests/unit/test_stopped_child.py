"""A child the heartbeat deadline kills because it was stopped from outside (SIGSTOP) is not a
crash: the requests in flight there become no suspects (engine/runtime/stopped.py)."""

from __future__ import annotations

import signal
import subprocess
import time

from engine.inflight.crashes import is_crash
from engine.runtime.events import ChildDied
from engine.runtime.stopped import STOPPED_FROM_OUTSIDE, is_stopped

HEARTBEAT = "no heartbeat for 6.2 s, heartbeat_timeout is 6 s"


def test_a_stopped_childs_death_is_no_crash_and_a_hung_ones_is() -> None:
    stopped = f"was killed by SIGKILL ({STOPPED_FROM_OUTSIDE}, {HEARTBEAT})"
    hung = f"was killed by SIGKILL ({HEARTBEAT})"
    assert not is_crash(ChildDied("scheduler", 1, -signal.SIGKILL, stopped))
    assert is_crash(ChildDied("scheduler", 1, -signal.SIGKILL, hung))
    assert not is_crash(ChildDied("scheduler", 1, -signal.SIGKILL, "was killed by SIGKILL"))


def test_the_kernel_tells_a_stopped_process_from_a_running_one() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        assert not is_stopped(proc.pid)
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10.0
        while not is_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert is_stopped(proc.pid)
        proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 10.0
        while is_stopped(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not is_stopped(proc.pid)
    finally:
        proc.kill()
        proc.wait(10)
    assert not is_stopped(proc.pid)  # gone
