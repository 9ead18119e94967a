"""CPU time of a process by pid, read from Linux's /proc (the actors' cost, for /metrics)."""

from __future__ import annotations

import os

_TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float | None:
    """User plus system CPU seconds of every thread of a live process; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            line = stat.read()
    except OSError:
        return None
    # The name (field 2) is in parentheses and may hold spaces: count fields after its ")".
    fields = line[line.rindex(b")") + 2 :].split()
    utime, stime = int(fields[11]), int(fields[12])  # fields 14 and 15 of proc(5)
    return (utime + stime) / _TICKS_PER_SECOND
