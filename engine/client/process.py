"""Child processes: `python -m engine COMMAND` started with its stdout piped, a line it prints
waited for, and the process (with its session, where it leads one) stopped. Only processes
started here are ever signalled."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

STOP_TIMEOUT_S = 60.0


def spawn_engine(
    command: list[str],
    log_path: Path,
    env: dict[str, str] | None = None,
    *,
    cwd: Path | None = None,
    own_session: bool = False,
) -> subprocess.Popen[str]:
    """`python -m engine <command>`, not waited for: stdout piped (for its ready line), stderr to
    `log_path`. `own_session`: it leads a session of its own, so stop_session() also ends
    whatever it started (its actors) and nothing else."""
    with open(log_path, "w") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "engine", *command],
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            start_new_session=own_session,
        )


def read_line_starting(proc: subprocess.Popen[str], prefix: str, timeout: float) -> str:
    """The first line `proc` prints that starts with `prefix` (others are skipped), within
    `timeout` seconds; an error if it exits or closes stdout first."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if not sel.select(timeout=0.5):
                if proc.poll() is not None:
                    raise RuntimeError(f"exited with {proc.returncode} before {prefix!r}")
                continue
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"stdout closed before {prefix!r} (exit {proc.wait(10)})")
            if line.startswith(prefix):
                return line.strip()
    raise TimeoutError(f"no line starting with {prefix!r} within {timeout:g} s")


def stop_process(
    proc: subprocess.Popen[str] | subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT_S
) -> int:
    """Terminate (SIGTERM: the engine drains), wait, kill if it will not go; the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()
    return proc.returncode


def stop_session(
    proc: subprocess.Popen[str] | subprocess.Popen[bytes], timeout: float = STOP_TIMEOUT_S
) -> None:
    """stop_process(), then anything still in the session `proc` leads gets the same time to go
    and is killed after (for a process started with its own session)."""
    stop_process(proc, timeout)
    deadline = time.monotonic() + timeout
    while _session_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # it led its session: pgid == its pid


def _session_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may still take it first)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
