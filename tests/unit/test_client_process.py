"""engine/client/process.py: stopping a server started in a session of its own leaves nothing of
it behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from engine.client.process import stop_session


def test_stopping_a_server_also_ends_what_it_left_in_its_session(tmp_path: Path) -> None:
    """A server whose child ignores SIGTERM and outlives it (as an actor or vLLM's engine core
    might): the child is killed once the grace time is over."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the server did not start its child"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    try:
        stop_session(proc, timeout=2.0)
        assert proc.returncode is not None
        assert _gone(lambda: os.kill(child, 0), timeout=10.0)  # killed, then reaped by init
        assert _gone(lambda: os.killpg(proc.pid, 0), timeout=10.0)  # nothing else in its session
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def _gone(probe: Callable[[], None], timeout: float) -> bool:
    """Whether `probe` (a signal 0) finds nothing within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            probe()
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
