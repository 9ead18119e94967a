"""The supervisor: Erlang/OTP's supervisor, run on the root process's event loop.

- start: sweep segments left by dead runs, create this run's rings, spawn every child at once,
  then await the Ready of each unit in start order (a group is one unit), each within its
  ready_timeout. Children never wait for a sibling to start (their rings and segments exist
  before any is spawned), so their start-ups overlap: the tokenizer imports its library while a
  worker loads its weights. Events, restarts and the shutdown still follow the start order.
- supervise: a death is seen through the process sentinel, a hang through missed heartbeats
  (the hung child is SIGKILLed, which makes it a death). One task handles deaths in turn, like
  the EXIT messages of an OTP supervisor: the restart type says whether to restart, the
  strategy says which children go with it, the restart intensity says whether restarting is
  still allowed; beyond it the supervisor escalates to an orderly shutdown that states why.
  Deaths that queued up meanwhile (while a restart was under way) are handled as one: each
  counts against the intensity, and their children restart together, paying one backoff and,
  under one_for_one, starting side by side rather than one after the other.
- restart: the children chosen are stopped (reverse start order), their rings get fresh
  segments, every live peer is told to swap (the root's own ends are swapped in place), and the
  children are started again (in the spare processes kept for their entries: spares.py).
- shutdown: every child in reverse start order (Stop, SIGTERM, SIGKILL), then every segment.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import TracebackType

from engine.messages.control import LogLevel, Ready
from engine.runtime.child_process import ChildProcess, ChildStartError, outcome
from engine.runtime.child_spec import (
    LOG_LEVELS,
    ROOT,
    Restart,
    Strategy,
    SupervisorSpec,
    start_units,
)
from engine.runtime.events import (
    ChildDied,
    ChildReady,
    ChildRestarted,
    ChildStatus,
    Escalated,
    RingsSwapped,
    SupervisorEvent,
)
from engine.runtime.restart_policy import RestartIntensity, restart_set
from engine.runtime.ring import run_prefix, sweep_stale_segments
from engine.runtime.ring_ends import RingEnds
from engine.runtime.ring_table import RingTable
from engine.runtime.segments import create_segments, destroy_segments
from engine.runtime.shm import release_run_directory
from engine.runtime.spares import Spares
from engine.runtime.supervised_child import SupervisedChild, wait_for_dying_siblings

__all__ = ["ChildStartError", "Supervisor"]

log = logging.getLogger(__name__)
WATCH_TICK_S = 0.2  # the liveness watchdog's period (engine/runtime/liveness.py)


class Supervisor:
    def __init__(self, spec: SupervisorSpec, doorbell_dir: str = "") -> None:
        spec.validate()
        self.spec = spec
        self._doorbell_dir = doorbell_dir
        self._units = start_units(spec.children)
        self._children = {child.name: SupervisedChild(child) for child in spec.children}
        self._intensity = RestartIntensity(
            spec.max_restarts, spec.max_seconds, spec.backoff_initial, spec.backoff_max
        )
        restartable = [c.entry for c in spec.children if c.restart is not Restart.TEMPORARY]
        self._spares = Spares(restartable if spec.spares else ())
        self._exits: asyncio.Queue[ChildProcess] = asyncio.Queue()
        self._processes: set[ChildProcess] = set()  # spawned and not yet released
        self._subscribers: list[asyncio.Queue[SupervisorEvent]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._rings: RingTable | None = None
        self._root: RingEnds | None = None
        self._prefix = ""
        self._segments: dict[str, str] = {}  # SegmentDecl name -> shared-memory name
        self._closing: asyncio.Task[None] | None = None
        self._closed: asyncio.Future[str] | None = None
        self.swept: list[str] = []  # stale segments removed at start

    # Public API.

    @property
    def root(self) -> RingEnds:
        """The root process's own ring ends (writer/reader "root" in the ring declarations)."""
        if self._root is None:
            raise RuntimeError("the supervisor has not been started")
        return self._root

    async def start(self) -> None:
        """Start every child and wait for each one to be ready; ChildStartError names a failure."""
        if self._closed is not None:
            raise RuntimeError("a Supervisor starts once; make a new one to start again")
        self._closed = asyncio.get_running_loop().create_future()
        self.swept = sweep_stale_segments([self._doorbell_dir] if self._doorbell_dir else None)
        if self.swept:
            log.warning("swept %d segment(s) left by dead runs: %s", len(self.swept), self.swept)
        self._prefix = run_prefix()
        self._rings = RingTable(self.spec.rings, self._prefix, self._doorbell_dir)
        self._rings.create_all()
        self._segments = create_segments(self.spec.segments, self._prefix)
        self._root = RingEnds(*self._rings.ends_of(ROOT))
        try:
            spawned = [[self._spawn(name) for name in unit] for unit in self._units]
            for processes in spawned:
                await self._await_ready(processes)
        except BaseException as exc:
            await self.shutdown(f"start-up failed: {exc}")
            raise
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._supervise(), name="supervise"),
            loop.create_task(self._watch_heartbeats(), name="heartbeat-watchdog"),
            loop.create_task(self._spares.refill_when_quiet(self.status), name="spares"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._on_task_done)

    async def shutdown(self, reason: str = "shutdown requested") -> None:
        """Stop every child in reverse start order and remove every segment; idempotent."""
        if self._closing is None:
            self._closing = asyncio.get_running_loop().create_task(self._shutdown(reason))
        await asyncio.shield(self._closing)

    async def wait_closed(self) -> str:
        """Wait until the supervisor has shut down (asked to, or escalated); the reason."""
        if self._closed is None:
            raise RuntimeError("the supervisor has not been started")
        return await asyncio.shield(self._closed)

    def subscribe(self) -> asyncio.Queue[SupervisorEvent]:
        """A queue that receives every event from now on."""
        queue: asyncio.Queue[SupervisorEvent] = asyncio.Queue()
        self._subscribers.append(queue)
        return queue

    def status(self) -> list[ChildStatus]:
        return [child.status() for child in self._children.values()]

    def spare_pids(self) -> dict[str, int | None]:
        """Entry -> pid of the spare process kept for its next restart (spec.spares)."""
        return self._spares.pids()

    def set_log_level(self, level: str, children: list[str] | None = None) -> None:
        """Change the log level of the named children (default: all) while they run."""
        if level not in LOG_LEVELS:
            raise ValueError(f"log level must be one of {LOG_LEVELS}, got {level!r}")
        for name in children or list(self._children):
            process = self._children[name].process
            if process is not None and process.alive:
                process.send_control(LogLevel(level))

    async def __aenter__(self) -> Supervisor:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.shutdown("shutdown requested" if exc is None else f"root failed: {exc!r}")

    # Starting.

    def _spawn(self, name: str) -> ChildProcess:
        assert self._rings is not None
        child = self._children[name]
        process = ChildProcess(
            child.spec, child.spawned, self._prefix, self._exits.put_nowait, self._doorbell_dir
        )
        child.spawned += 1
        child.replace_process(process)
        child.state = "starting"
        self._processes.add(process)
        segments = {
            decl.name: self._segments[decl.name]
            for decl in self.spec.segments
            if name in decl.parties and decl.name in self._segments
        }
        spare = self._spares.take(child.spec.entry)
        process.start(*self._rings.ends_of(name), self.spec.log_level, segments, spare)
        return process

    async def _start_unit(self, names: list[str], restart_reason: str = "") -> None:
        """Spawn every member, then await every Ready: members may need each other to start."""
        await self._await_ready([self._spawn(name) for name in names], restart_reason)

    async def _await_ready(self, processes: list[ChildProcess], restart_reason: str = "") -> None:
        results = await asyncio.gather(*(p.wait_ready() for p in processes), return_exceptions=True)
        errors: list[BaseException] = []
        for process, result in zip(processes, results, strict=True):
            child = self._children[process.name]
            if isinstance(result, Ready):
                child.state = "running"
                child.came_up()
                self._emit(ChildReady(process.name, result.pid, process.generation, result.info))
                if restart_reason:
                    event = ChildRestarted(
                        process.name, result.pid, process.generation, child.restarts, restart_reason
                    )
                    self._emit(event)
            else:
                errors.append(result)
                process.kill(str(result))  # a late child is not waited for any longer
        if errors:
            for error in errors[1:]:
                log.error("%s", error)
            raise errors[0]

    # Supervising.

    async def _supervise(self) -> None:
        while True:
            failures = await self._next_failures()
            if failures and not await self._on_failures(failures):
                return

    async def _next_failures(self) -> list[ChildProcess]:
        """The next death and every other one already queued, less the exits the supervisor
        caused itself (a stop, a process replaced meanwhile)."""
        exited = [await self._exits.get()]
        await wait_for_dying_siblings(self._children.values())
        while not self._exits.empty():
            exited.append(self._exits.get_nowait())
        failures = []
        for process in exited:
            await self._release(process)
            if process is self._children[process.name].process and not process.stopping:
                failures.append(process)
        return failures

    async def _on_failures(self, processes: list[ChildProcess]) -> bool:
        """Restart as the policy says; False once the supervisor has escalated."""
        failed: list[str] = []
        reasons: list[str] = []
        for process in processes:
            exitcode = process.exited.result()
            how = process.describe_exit()
            self._emit(ChildDied(process.name, process.pid or 0, exitcode, how))
            if not self._children[process.name].spec.restart.wants_restart(exitcode):
                self._children[process.name].state = "exited"
                continue
            reason = f"{process.name} {how}"
            if not self._intensity.record(process.name):
                self._escalate(
                    f"restart intensity reached, {self._intensity.describe()}; last: {reason}"
                )
                return False
            failed.append(process.name)
            reasons.append(reason)
        if failed:
            await self._restart(failed, "; ".join(reasons))
        return True

    async def _restart(self, failed: list[str], reason: str) -> None:
        assert self._rings is not None
        chosen_sets = [restart_set(self.spec.strategy, self._units, name) for name in failed]
        chosen = [name for name in self._start_order if any(name in c for c in chosen_sets)]
        peer = ", ".join(failed)
        for name in reversed(chosen):  # siblings go in reverse start order, as at shutdown
            sibling = self._children[name]
            if name not in failed and sibling.process is not None and sibling.process.alive:
                sibling.state = "stopping"
                await sibling.process.stop(f"restarting with {peer}")
                sibling.state = "stopped"
        # Temporary children are never restarted, and children that finished stay finished.
        restarting = [
            name
            for name in chosen
            if name in failed
            or (
                self._children[name].spec.restart is not Restart.TEMPORARY
                and self._children[name].state != "exited"
            )
        ]
        for name in restarting:
            child = self._children[name]
            child.state = "restarting"
            child.went_down()
            child.restarts += 1
            child.last_restart_reason = reason
        delay = self._intensity.backoff(failed)
        if delay:
            log.info("restarting %s in %.2f s (backoff)", restarting, delay)
            await asyncio.sleep(delay)
        log.info("restarting %s: %s", restarting, reason)
        renewed = self._rings.renew_touching(restarting)
        await self._hand_out_rings(renewed, restarted=set(restarting), peer=peer)
        units = [
            members for unit in self._units if (members := [n for n in unit if n in restarting])
        ]
        try:
            results: list[BaseException | None]
            if self.spec.strategy is Strategy.ONE_FOR_ONE:
                # Independent units: none waits for another to be ready.
                starts = (self._start_unit(members, restart_reason=reason) for members in units)
                results = await asyncio.gather(*starts, return_exceptions=True)
            else:  # later units may need the earlier ones running, as at start-up
                results = [
                    await outcome(self._start_unit(members, restart_reason=reason))
                    for members in units
                ]
            for result in results:
                if isinstance(result, ChildStartError):
                    # The child was killed (or died): its exit comes back through the queue.
                    log.error("restart failed: %s", result)
                elif isinstance(result, BaseException):
                    raise result
        finally:
            self._rings.destroy_retired()
            self._spares.refill()  # after the restart: the new spare's imports wait for it

    async def _hand_out_rings(self, renewed: list[str], restarted: set[str], peer: str) -> None:
        """Move every live party with an end on a renewed ring to the fresh segment, and wait
        until each has: after that nothing can be written into a retired ring."""
        assert self._rings is not None
        swaps: list[tuple[ChildProcess, asyncio.Task[bool]]] = []
        for party in self._rings.parties(renewed) - restarted:
            inbound, outbound = self._rings.ends_of(party, renewed)
            if party == ROOT:
                self.root.swap(inbound, outbound)
                self._emit(RingsSwapped(peer, sorted({*inbound, *outbound})))
                continue
            process = self._children[party].process
            if process is not None and process.alive:  # a dead one gets them when it restarts
                swap = asyncio.ensure_future(process.swap_rings(peer, inbound, outbound))
                swaps.append((process, swap))
        for process, swap in swaps:
            if not await swap:
                process.kill(f"did not confirm the ring swap after {peer} restarted")

    async def _watch_heartbeats(self) -> None:
        # Ticks at most WATCH_TICK_S apart: a stopped process is seen within two of them.
        period = min(WATCH_TICK_S, *(child.heartbeat_interval for child in self.spec.children))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for child in self._children.values():
                child.kill_if_hung(now)

    # Ending.

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        """A supervisor that cannot supervise must not pretend to: shut down and say why."""
        if not task.cancelled() and task.exception() is not None:
            log.error("supervisor task %s failed", task.get_name(), exc_info=task.exception())
            self._escalate(f"supervisor task {task.get_name()} failed: {task.exception()!r}")

    def _escalate(self, reason: str) -> None:
        log.error("escalating to shutdown: %s", reason)
        self._emit(Escalated(reason))
        if self._closing is None:
            loop = asyncio.get_running_loop()
            self._closing = loop.create_task(self._shutdown(f"escalated: {reason}"))

    async def _shutdown(self, reason: str) -> None:
        log.info("shutting down: %s", reason)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._spares.close()
        for unit in reversed(self._units):
            await asyncio.gather(*(self._stop_child(name, reason) for name in reversed(unit)))
        for process in list(self._processes):
            await self._release(process)
        if self._root is not None:
            self._root.close()
        if self._rings is not None:
            self._rings.destroy_all()
        destroy_segments(self._segments)
        release_run_directory()  # kept while another supervisor's, or restart files, are there
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(reason)
        log.info("shut down: %s", reason)

    async def _stop_child(self, name: str, reason: str) -> None:
        child = self._children[name]
        if child.process is not None and child.process.alive:
            child.state = "stopping"
            await child.process.stop(reason)
        if child.state != "exited":
            child.state = "stopped"

    async def _release(self, process: ChildProcess) -> None:
        if process in self._processes:
            self._processes.discard(process)
            await process.release()

    @property
    def _start_order(self) -> list[str]:
        return [name for unit in self._units for name in unit]

    def _emit(self, event: SupervisorEvent) -> None:
        log.debug("event %r", event)
        for queue in self._subscribers:
            queue.put_nowait(event)
