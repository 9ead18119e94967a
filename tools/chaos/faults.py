"""The faults tools/chaos/run.py injects: actors of one or more instances SIGKILLed or SIGSTOPped.

Three kinds, drawn at random among those asked for:

- kill:  SIGKILL. The supervisor sees the death through the process sentinel and restarts it.
- hang:  SIGSTOP, and left stopped. Nothing dies: the supervisor sees the process stopped in
         /proc (runtime.stopped_timeout, 0.5 s by default), SIGKILLs it and restarts it.
- pause: SIGSTOP for a while shorter than runtime.stopped_timeout, then SIGCONT. Nothing
         restarts; the streams stall and must go on unharmed.

Victims are drawn from the running actors the admin socket of each instance lists (`actors`);
with several instances (a P/D pair) a victim is named `<instance>:<actor>`. A hung actor that is
still stopped when the run ends is counted (the supervisor never replaced it) and then resumed,
so nothing is left stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.cli.admin_client import send_command

KINDS = ("kill", "hang", "pause")


@dataclass(frozen=True)
class Fault:
    at: float  # monotonic time it was injected
    kind: str
    name: str  # <instance>:<actor>, or the actor's name with one instance
    pid: int


@dataclass
class FaultPlan:
    kinds: tuple[str, ...]
    count: int
    min_gap: float
    max_gap: float
    pause_s: tuple[float, float]  # a pause lasts from..to seconds
    targets: frozenset[str] | None  # actor names (without instance) that may be hit
    sockets: dict[str, str | None]  # instance -> admin socket (None: the newest live one)
    hung: list[Fault] = field(default_factory=list)  # SIGSTOPped and not (yet) resumed by us


async def admin_actors(socket: str | None) -> list[dict[str, Any]]:
    """The rows of the admin `actors` command (the pids to hit come from here)."""
    if socket is not None:
        reply = await asyncio.to_thread(send_command, Path(socket), "actors", [], timeout=60.0)
    else:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "engine",
            "admin",
            "actors",
            "--json",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 60)
        if proc.returncode != 0:
            raise RuntimeError(f"engine admin actors failed: {stderr.decode().strip()}")
        reply = json.loads(stdout)
    if not reply.get("ok"):
        raise RuntimeError(f"engine admin actors refused: {reply.get('error')}")
    rows: list[dict[str, Any]] = reply["result"]
    return rows


async def all_actors(plan: FaultPlan) -> list[dict[str, Any]]:
    """Every instance's actor rows, each named as a victim would be."""
    rows = []
    several = len(plan.sockets) > 1
    for instance, socket in plan.sockets.items():
        for row in await admin_actors(socket):
            rows.append({**row, "name": f"{instance}:{row['name']}" if several else row["name"]})
    return rows


def _short_name(name: str) -> str:
    return name.rpartition(":")[2]


async def inject_faults(plan: FaultPlan, rng: random.Random, done: asyncio.Event) -> list[Fault]:
    """Inject up to plan.count faults at random gaps until `done`; the faults injected."""
    faults: list[Fault] = []
    pauses: list[asyncio.Task[None]] = []
    while len(faults) < plan.count and not done.is_set():
        try:
            await asyncio.wait_for(done.wait(), rng.uniform(plan.min_gap, plan.max_gap))
            break  # the workload ended
        except TimeoutError:
            pass
        stopped = {fault.pid for fault in plan.hung}
        running = [
            row
            for row in await all_actors(plan)
            if row["state"] == "running"
            and row["pid"]
            and row["pid"] not in stopped
            and (plan.targets is None or _short_name(row["name"]) in plan.targets)
        ]
        if not running:
            continue  # everything is restarting; try again after the next gap
        victim = rng.choice(running)
        fault = Fault(time.monotonic(), rng.choice(plan.kinds), victim["name"], victim["pid"])
        if not _hit(fault):
            continue
        faults.append(fault)
        if fault.kind == "hang":
            plan.hung.append(fault)
        elif fault.kind == "pause":
            pauses.append(asyncio.ensure_future(_resume_later(fault, rng.uniform(*plan.pause_s))))
        print(f"  fault {len(faults):3d}: {fault.kind} {fault.name} (pid {fault.pid})", flush=True)
    await asyncio.gather(*pauses)
    return faults


def _hit(fault: Fault) -> bool:
    sig = signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP
    try:
        os.kill(fault.pid, sig)
    except ProcessLookupError:
        return False
    return True


async def _resume_later(fault: Fault, seconds: float) -> None:
    await asyncio.sleep(seconds)
    with contextlib.suppress(ProcessLookupError):  # gone: the pause outlived the heartbeat timeout
        os.kill(fault.pid, signal.SIGCONT)


async def still_stopped(plan: FaultPlan, deadline_s: float) -> list[Fault]:
    """Hung actors the supervisor did not replace within `deadline_s` (still there, still
    stopped); each is then resumed so that nothing is left stopped."""
    until = time.monotonic() + deadline_s
    while any(_state_of(f.pid) == "T" for f in plan.hung) and time.monotonic() < until:
        await asyncio.sleep(0.2)
    left = []
    for fault in plan.hung:
        if _state_of(fault.pid) == "T":
            left.append(fault)
            os.kill(fault.pid, signal.SIGCONT)
    return left


async def all_running(plan: FaultPlan, deadline_s: float) -> bool:
    """Wait until every actor of every instance runs again (the undisturbed run must start on
    a whole engine); False if some still do not after `deadline_s`."""
    until = time.monotonic() + deadline_s
    while time.monotonic() < until:
        if all(row["state"] == "running" for row in await all_actors(plan)):
            return True
        await asyncio.sleep(0.5)
    return False


def _state_of(pid: int) -> str:
    """The process's state letter from /proc (T: stopped), '' once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rpartition(")")[2].split()[0]


def faults_by(faults: list[Fault]) -> dict[str, int]:
    """Counts by '<kind> <victim>'."""
    counts: dict[str, int] = {}
    for fault in faults:
        key = f"{fault.kind} {fault.name}"
        counts[key] = counts.get(key, 0) + 1
    return counts
