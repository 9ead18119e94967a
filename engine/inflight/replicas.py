"""Data-parallel replicas behind the one gateway: M supervisors presented to AsyncLLM as one.

Each replica is a whole pipeline (tokenizer, scheduler, detokenizer, its TP group of worker
ranks) with a supervisor of its own (engine/launch/plan.py builds the specs), so:

- the replicas start in parallel (every supervisor's start is awaited together);
- a failing actor restarts within its replica; the others never stop (their supervisors are not
  involved, and only the restarted replica's requests are resubmitted), and a replica that
  exceeds its restart intensity stops alone: its requests move to the live replicas, and the
  engine gives up only when no replica is left;
- each prompt is tokenized once, by the tokenizer of the replica it was routed to.

`ReplicaSet` implements `Supervision` as a Supervisor does: `root` (send requests: routed by
`LeastPendingRouter`; receive outputs, failures and reports: merged from every replica),
`subscribe`, `start`, `shutdown`, `wait_closed`, `status`, `set_log_level`; a replica that gives
up is reported as `ReplicaFailed`. It also implements `Replicas`, the questions AsyncLLM asks
about placement (which requests a restart concerns, which replica serves a request, per-replica
figures), which `OneReplica` answers for an engine of one. Scheduler reports are merged into one
(counts summed, ratios averaged) for the engine-wide figures.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from engine.inflight.registry import Gateway
from engine.inflight.router import LeastPendingRouter, pending_tokens
from engine.messages.admin import ReplicaRow
from engine.messages.reports import SchedulerReport
from engine.messages.ring_catalogue import REPORTS_RING, ring_of
from engine.messages.scheduling import SchedulerStats
from engine.runtime.child_spec import SupervisorSpec
from engine.runtime.events import ChildStatus, Escalated, ReplicaFailed, SupervisorEvent
from engine.runtime.ring import RingClosed
from engine.runtime.supervision import Received, RootEnds, Supervision
from engine.runtime.supervisor import Supervisor

log = logging.getLogger(__name__)


class Replicas(Protocol):
    """What AsyncLLM asks about where requests run."""

    def requests_concerned(self, restarted: Sequence[str]) -> set[str] | None:
        """The requests a restart of these actors concerns; None: every request."""
        ...

    def requests_of_failed(self, replica: int) -> set[str]:
        """The requests a failed replica held, now to be resubmitted elsewhere."""
        ...

    def replica_of(self, request_id: str) -> int | None: ...

    def replica_stats(self, report: SchedulerReport | None) -> list[ReplicaRow]:
        """One row per replica: state, load and its scheduler's figures."""
        ...


class OneReplica:
    """`Replicas` for an engine of one replica: every request is on it."""

    def __init__(self, gateway: Gateway, max_model_len: int, role: str = "both") -> None:
        self._gateway = gateway
        self._max_model_len = max_model_len
        self._role = role

    def requests_concerned(self, restarted: Sequence[str]) -> set[str] | None:
        return None

    def requests_of_failed(self, replica: int) -> set[str]:
        return set()  # one replica failing is the engine failing (Escalated)

    def replica_of(self, request_id: str) -> int | None:
        return 0 if request_id in self._gateway else None

    def replica_stats(self, report: SchedulerReport | None) -> list[ReplicaRow]:
        records = self._gateway.records()
        return [
            ReplicaRow(
                **_figures(report),
                replica=0,
                role=self._role,
                state="running",
                in_flight=len(self._gateway),
                pending_tokens=sum(pending_tokens(r, self._max_model_len) for r in records),
            )
        ]


class ReplicaSet:
    def __init__(
        self,
        specs: Sequence[SupervisorSpec],
        gateway: Gateway,
        max_model_len: int,
        roles: Sequence[str] | None = None,
    ) -> None:
        self.supervisors = [Supervisor(spec) for spec in specs]
        self.replica_of_actor = {
            child.name: replica for replica, spec in enumerate(specs) for child in spec.children
        }
        self.router = LeastPendingRouter(len(specs), gateway, max_model_len, roles)
        self.reports: list[SchedulerReport | None] = [None] * len(specs)
        self.failed: dict[int, str] = {}  # replica -> why it stopped
        self._root = _MergedRoot(self)
        self._subscribers: list[asyncio.Queue[SupervisorEvent]] = []
        self._tasks: list[asyncio.Task[None]] = []

    # ---- Supervision ---------------------------------------------------------------------------

    @property
    def root(self) -> RootEnds:
        return self._root

    async def start(self) -> None:
        """Start every replica at once; if one fails to start, stop them all and raise."""
        loop = asyncio.get_running_loop()
        for replica, supervisor in enumerate(self.supervisors):
            events = supervisor.subscribe()
            self._tasks.append(
                loop.create_task(self._forward_events(replica, events), name=f"replica{replica}")
            )
        results = await asyncio.gather(
            *(supervisor.start() for supervisor in self.supervisors), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.shutdown(f"start-up failed: {errors[0]}")
            raise errors[0]
        for replica, supervisor in enumerate(self.supervisors):
            self._tasks.append(
                loop.create_task(self._root.pump(replica, supervisor), name=f"pump{replica}")
            )

    async def shutdown(self, reason: str = "shutdown requested") -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(supervisor.shutdown(reason) for supervisor in self.supervisors))
        self._root.close()

    async def wait_closed(self) -> str:
        reasons = await asyncio.gather(*(s.wait_closed() for s in self.supervisors))
        return "; ".join(dict.fromkeys(reasons))

    def subscribe(self) -> asyncio.Queue[SupervisorEvent]:
        queue: asyncio.Queue[SupervisorEvent] = asyncio.Queue()
        self._subscribers.append(queue)
        return queue

    def status(self) -> list[ChildStatus]:
        """Every actor of the live replicas (a replica that gave up is no longer the engine's:
        `replica_stats` shows it as failed)."""
        return [
            row
            for replica, supervisor in enumerate(self.supervisors)
            if replica not in self.failed
            for row in supervisor.status()
        ]

    def set_log_level(self, level: str) -> None:
        for replica, supervisor in enumerate(self.supervisors):
            if replica not in self.failed:
                supervisor.set_log_level(level)

    # ---- Replicas ------------------------------------------------------------------------------

    def requests_concerned(self, restarted: Sequence[str]) -> set[str] | None:
        """Those of the restarted actors' replicas (and any routed nowhere now)."""
        replicas = {self.replica_of_actor[n] for n in restarted if n in self.replica_of_actor}
        return self.router.requests_on(replicas)

    def requests_of_failed(self, replica: int) -> set[str]:
        """Its requests were unrouted when it failed: they go wherever the router sends them."""
        return self.router.requests_on({replica})

    def replica_of(self, request_id: str) -> int | None:
        return self.router.replica_of.get(request_id)

    def replica_stats(self, report: SchedulerReport | None = None) -> list[ReplicaRow]:
        loads = self.router.loads()
        requests = self.router.requests()
        return [
            ReplicaRow(
                **_figures(own),
                replica=replica,
                role=self.router.roles[replica],
                state="failed" if replica in self.failed else "running",
                in_flight=requests[replica],
                pending_tokens=loads[replica],
                routed_requests=self.router.routed[replica],
                reason=self.failed.get(replica),
            )
            for replica, own in enumerate(self.reports)
        ]

    async def _forward_events(self, replica: int, events: asyncio.Queue[SupervisorEvent]) -> None:
        while True:
            event = await events.get()
            if isinstance(event, Escalated):
                event = self._replica_gave_up(replica, event.reason)
            for queue in self._subscribers:
                queue.put_nowait(event)

    def _replica_gave_up(self, replica: int, reason: str) -> SupervisorEvent:
        """One replica's supervisor escalated: the engine goes on with the others, if any."""
        self.failed[replica] = reason
        moved = self.router.mark_dead(replica)
        live = self.router.live
        if not live:
            return Escalated(f"every replica gave up; replica {replica}: {reason}")
        log.error(
            "replica %d gave up (%s); its %d request(s) move to replica(s) %s",
            replica,
            reason,
            len(moved),
            live,
        )
        # AsyncLLM resubmits what was in flight there; the router sends it to the live ones.
        return ReplicaFailed(replica, reason)


class _MergedRoot:
    """The root's ends of every replica as one: sends are routed, receipts merged."""

    def __init__(self, replicas: ReplicaSet) -> None:
        self._replicas = replicas
        self._received: asyncio.Queue[Received | None] = asyncio.Queue()
        self._pumping = len(replicas.supervisors)

    async def send_many(self, ring: str, frames: Sequence[bytes]) -> bool:
        """Gateway -> tokenizer frames (REQUESTS_RING), each to its replica's tokenizer."""
        sent = True
        for replica, part in self._replicas.router.route(frames).items():
            supervisor = self._replicas.supervisors[replica]
            sent = await supervisor.root.send_many(ring, part) and sent
        return sent

    async def recv(self) -> Received:
        """What any replica sent the root; RingClosed once every replica has stopped."""
        while True:
            batch = await self._received.get()
            if batch is None:
                self._pumping -= 1
                if self._pumping <= 0:
                    self._received.put_nowait(None)  # every later recv fails the same way
                    raise RingClosed("every replica has stopped")
                continue
            # Outputs and failures change the loads once AsyncLLM has applied them, which it
            # does before it next awaits: recount at the next use (not earlier, or a count
            # taken in between would keep requests that have finished).
            self._replicas.router.invalidate()
            return batch

    async def pump(self, replica: int, supervisor: Supervisor) -> None:
        """Move one replica's receipts into the merged queue (until its supervisor stops)."""
        try:
            while True:
                try:
                    received = await supervisor.root.recv()
                except RingClosed:
                    return
                batch: Received = []
                for ring, frames in received:
                    if ring_of(ring) is REPORTS_RING:
                        batch.append((ring, [self._merge_reports(replica, frames)]))
                        continue
                    batch.append((ring, frames))
                self._received.put_nowait(batch)
        finally:
            self._received.put_nowait(None)

    def _merge_reports(self, replica: int, frames: list[bytes]) -> bytes:
        reports = REPORTS_RING.decode_many(frames)
        if reports:
            self._replicas.reports[replica] = reports[-1]
        # A replica that gave up is no longer the engine's: its last figures (and requests,
        # which moved to the others) must not count twice.
        failed = self._replicas.failed
        live = [
            r for i, r in enumerate(self._replicas.reports) if r is not None and i not in failed
        ]
        return REPORTS_RING.encode(merge_reports(live))

    def close(self) -> None:
        self._received.put_nowait(None)


def merge_reports(reports: Sequence[SchedulerReport]) -> SchedulerReport:
    """One report for several schedulers: counts summed; the KV usage averaged (every replica
    has as many blocks); the prefix-cache hit rate recomputed from the summed token counts, so
    a busy replica weighs as much as its traffic."""
    merged: dict[str, Any] = {}
    for report in reports:
        for name, value in msgspec.structs.asdict(report.stats).items():
            merged[name] = _summed(merged.get(name), value)
    if reports:
        merged["kv_usage"] /= len(reports)
        queried = merged["prefix_cache_queried_tokens"]
        merged["prefix_cache_hit_rate"] = (
            merged["prefix_cache_hit_tokens"] / queried if queried else 0.0
        )
    stats = msgspec.convert(merged, SchedulerStats)
    return SchedulerReport(stats, [status for report in reports for status in report.requests])


def _summed(total: Any, value: Any) -> Any:
    """A count summed over replicas; a list of counts (by position) summed item by item."""
    if not isinstance(value, list):
        return (total or 0) + value
    total = list(total or [])
    total += [0] * (len(value) - len(total))
    return [count + (value[i] if i < len(value) else 0) for i, count in enumerate(total)]


def supervise(
    specs: Sequence[SupervisorSpec],
    gateway: Gateway,
    max_model_len: int,
    roles: Sequence[str] | None = None,
) -> tuple[Supervision, Replicas]:
    """What AsyncLLM drives: a plain Supervisor for one replica, a ReplicaSet for more."""
    if len(specs) == 1:
        role = roles[0] if roles else "both"
        return Supervisor(specs[0]), OneReplica(gateway, max_model_len, role)
    replicas = ReplicaSet(specs, gateway, max_model_len, roles)
    return replicas, replicas


def _figures(report: SchedulerReport | None) -> dict[str, Any]:
    """A scheduler's figures as fields (none before its first report: the defaults, zeros)."""
    return msgspec.structs.asdict(report.stats) if report is not None else {}
