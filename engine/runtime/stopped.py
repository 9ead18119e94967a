"""Telling a child stopped from outside from one that hangs.

Both go silent, and the heartbeat deadline kills both. A hang may be a request's doing (a step
that never ends), so the requests in flight at a hung actor become suspects. A child stopped by
a signal (SIGSTOP, SIGTSTP, a debugger) was stopped by an operator or a test, not by a request:
the kernel shows it in the process's state, and the supervisor names it in the kill's reason so
that its death is not held against the requests in flight there.
"""

from __future__ import annotations

from pathlib import Path

STOPPED_FROM_OUTSIDE = "stopped by a signal from outside"
_STOPPED_STATES = frozenset({"T", "t"})  # stopped by a signal; stopped by a tracer


def is_stopped(pid: int) -> bool:
    """Whether `pid` is stopped by a signal or a tracer right now (False once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rpartition(")")[2].split()  # the command name may hold spaces and ')'
    return bool(fields) and fields[0] in _STOPPED_STATES
