"""`python -m engine --nnodes N --node-rank K ...` with K > 0: a host that only runs worker ranks.

Node 0 is the engine (API, gateway, schedulers, rank 0 of every replica). Node K runs its share
of every replica's TP ranks (engine/launch/ranks.py: `plan_worker_node`), one supervisor per replica
as on node 0, and serves nothing else: its ranks join rank 0's process group at
master_addr:master_port (+ replica index) and run the plans rank 0 relays over it. Every launch
takes the same model and parallel flags.

When it is ready it prints one line, `engine worker node K/N ready: ...`; SIGINT or SIGTERM
stops it. A rank that loses rank 0 stops and is restarted by its supervisor, which makes it wait
for rank 0's next generation; past the restart intensity the node exits with status 1.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Any

import uvloop

from engine.launch.model_source import model_directory
from engine.launch.ranks import plan_worker_node
from engine.runtime.shm_space import ShmSpaceError, require_shm_space
from engine.runtime.supervisor import Supervisor
from engine.settings import Settings, resolve_home

log = logging.getLogger("engine.node")


def serve_worker_node(settings: Settings) -> int:
    logging.basicConfig(
        stream=sys.stderr,
        level=settings.runtime.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return uvloop.run(_serve(settings))


async def _serve(settings: Settings) -> int:
    try:
        model_path, _ = model_directory(
            settings.model.path, resolve_home(settings), settings.model.tokenizer
        )
        specs = plan_worker_node(settings, model_path)
    except ValueError as exc:
        print(f"engine: {exc}", file=sys.stderr)
        return 2
    try:
        require_shm_space(specs)  # as a single-host start: a refusal now, not a SIGBUS later
    except ShmSpaceError as exc:
        print(f"engine: worker node did not start: {exc}", file=sys.stderr)
        return 1
    supervisors = [Supervisor(spec) for spec in specs]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    starting = asyncio.gather(*(s.start() for s in supervisors))
    stopped = asyncio.ensure_future(stop.wait())
    either: list[asyncio.Future[Any]] = [starting, stopped]
    await asyncio.wait(either, return_when="FIRST_COMPLETED")
    if not starting.done():  # a signal came first
        starting.cancel()
        stopped.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await _shutdown(supervisors, "stopped during start-up")
        return 0
    if starting.exception() is not None:
        await _shutdown(supervisors, "start-up failed")
        print(f"engine: worker node did not start: {starting.exception()}", file=sys.stderr)
        return 1
    parallel = settings.parallel
    names = [child.name for spec in specs for child in spec.children]
    print(
        f"engine worker node {parallel.node_rank}/{parallel.nnodes} ready: {', '.join(names)} "
        f"(rank 0 at {parallel.master_addr}:{parallel.master_port})",
        flush=True,
    )
    closed = [asyncio.ensure_future(s.wait_closed()) for s in supervisors]
    waiting = [asyncio.ensure_future(stop.wait()), *closed]
    await asyncio.wait(waiting, return_when="FIRST_COMPLETED")
    gave_up = [task.result() for task in closed if task.done()]
    for task in waiting:
        task.cancel()
    await _shutdown(supervisors, "stop requested" if not gave_up else gave_up[0])
    if gave_up:
        print(f"engine: worker node gave up: {gave_up[0]}", file=sys.stderr)
        return 1
    return 0


async def _shutdown(supervisors: list[Supervisor], reason: str) -> None:
    await asyncio.gather(*(s.shutdown(reason) for s in supervisors), return_exceptions=True)
