"""The scheduler actor: a thin shell that feeds rings into `Scheduler` and its plans back out.

Inbound: requests from the tokenizer (SUBMIT_RING), one StepResult per step from worker rank 0
(RESULTS_RING), stop-string stops from the detokenizer (STOPS_RING). Outbound: one StepPlan per
step to every rank (PLAN_RING, broadcast), to the detokenizer a TextStart per request taken in
and one TokenBatch per step (TOKENS_RING), and a periodic report to the root (REPORTS_RING).
Exactly one step is in flight at a time (the rings: engine/messages/ring_catalogue.py).

With P/D disaggregation (engine/scheduler/kv_handoff.py) it also orders its kv_transfer actors
(KV_ORDERS_RING, broadcast: holds and pulls), hears each rank's events (KV_EVENTS_RING), and
checks holds and pulls against their deadlines once a second. Orders go out before the tokens
of the same step, so a handoff never reaches a puller before its hold reached the ranks' ring.

A request that breaks something here fails alone: a submission the scheduler cannot take in, or
sequences the workers could not compute (WorkerFailed), become a RequestFailed with status
500 for the detokenizer to pass on; the other requests go on. A RequestFailed from the tokenizer
is passed on the same way (the scheduler drops whatever it held of that request).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec

from engine.kv.cache.prefix_index import PrefixIndex
from engine.kv.disk.mover import DiskMover, open_mover
from engine.kv.disk.orders import DiskEvent
from engine.messages.codec import encode_in_frames, too_large_for_one_frame
from engine.messages.failures import RequestFailed
from engine.messages.kv_transfer import KV_EVENTS
from engine.messages.reports import SchedulerReport
from engine.messages.ring_catalogue import (
    KV_EVENTS_RING,
    KV_ORDERS_RING,
    PLAN_RING,
    REPORTS_RING,
    RESULTS_RING,
    STOPS_RING,
    SUBMIT_RING,
    TOKENS_RING,
    ring_of,
)
from engine.messages.roles import Role
from engine.messages.scheduling import (
    SCHEDULER_REQUESTS,
    AbortRequests,
    SchedulerStats,
    StopSamples,
    SubmitRequest,
    TokenBatch,
    ToScheduler,
)
from engine.messages.steps import STEP_RESULTS, StepPlan, StepResult
from engine.runtime.actor import Actor
from engine.runtime.segments import map_segment
from engine.scheduler.admission import failed
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.step_times import StepTimes
from engine.text.detokenizer import text_start

REPORT_INTERVAL_S = 0.2  # the admin socket's and /metrics' view may lag this much
KV_TICK_S = 1.0  # how often KV holds and pulls are checked against their deadlines


class SchedulerActor(Actor):
    channels = (SCHEDULER_REQUESTS, STEP_RESULTS, KV_EVENTS)
    role = Role.SCHEDULER

    async def on_start(self) -> dict[str, Any] | None:
        config = msgspec.msgpack.decode(self.config, type=SchedulerConfig)
        self._disk = self._open_disk_tier(config)
        # Ids past any a former generation can have used (the workers may still answer it).
        self.scheduler = Scheduler(
            config,
            first_id=self.generation << 40,
            prefix_index=self._prefix_index(config),
            on_disk=None if self._disk is None else self._disk.store.contains,
        )
        if self.generation:
            cached = self.scheduler.kv.pool.num_cached_free_blocks
            self.log.info("restarted with %d cached KV blocks from the prefix index", cached)
        self._max_frame_bytes = self.rings.writer(TOKENS_RING.name).spec.max_frame_bytes
        self._last_report = 0.0
        self._reported_stats: SchedulerStats | None = None
        self._step_times = StepTimes()
        self._planned_at = 0.0  # when the latest plan was made, before it was sent
        self._publish_report()  # so the root's stats are complete from the start
        self._kv_ticker: asyncio.Task[None] | None = None
        if self.scheduler.kv_transfer is not None:
            self._kv_ticker = asyncio.get_running_loop().create_task(self._tick_kv_transfer())
        return {"num_blocks": config.num_blocks}

    def _prefix_index(self, config: SchedulerConfig) -> PrefixIndex | None:
        """The prefix cache's record in its segment of the run, when the plan gave it one."""
        if not config.prefix_index_segment:
            return None
        memory = map_segment(self.segments[config.prefix_index_segment])
        return PrefixIndex(memoryview(memory), config.num_blocks)

    def _open_disk_tier(self, config: SchedulerConfig) -> DiskMover | None:
        """The prefix cache's disk tier over the ranks' cache segments, when the plan gave one;
        one that cannot be opened is logged and left off (the engine serves without it)."""
        disk = config.kv_disk
        if disk is None:
            return None
        loop = asyncio.get_running_loop()
        self._disk_events: asyncio.Queue[DiskEvent] = asyncio.Queue()

        def report(event: DiskEvent) -> None:  # on the mover's thread
            with contextlib.suppress(RuntimeError):  # the loop closed: the actor is ending
                loop.call_soon_threadsafe(self._disk_events.put_nowait, event)

        try:
            buffers = [map_segment(self.segments[name]) for name in disk.cache_segments]
            mover = open_mover(disk, buffers, report)
        except OSError as exc:
            self.log.error("the prefix cache's disk tier at %s is off: %s", disk.path, exc)
            return None
        self.log.info("prefix cache disk tier: %s (%s)", mover.store.directory, disk.description)
        self._disk_task = loop.create_task(self._apply_disk_events(), name="kv-disk")
        self._disk_task.add_done_callback(self._on_disk_task_done)
        return mover

    async def _apply_disk_events(self) -> None:
        """The mover's answers: blocks written (their holds end), blocks read (the requests
        that waited for them are queued)."""
        while True:
            events = [await self._disk_events.get()]
            while not self._disk_events.empty():
                events.append(self._disk_events.get_nowait())
            failures = [f for event in events for f in self.scheduler.on_disk_event(event)]
            await self._plan_next()
            self._send_disk_orders()
            if failures:
                await self.send_many(TOKENS_RING, [TOKENS_RING.encode(f) for f in failures])
            self._publish_report()

    def _on_disk_task_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled():  # the scheduler would wait for its blocks forever: restart
            self.stop(f"the disk tier's task ended: {task.exception()!r}")

    def _send_disk_orders(self) -> None:
        if self._disk is not None:
            orders = self.scheduler.take_disk_orders()
            if orders:
                self._disk.submit(orders)

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        to_detokenizer: list[bytes] = []
        entry = ring_of(ring)
        if entry is KV_EVENTS_RING:
            assert self.scheduler.kv_transfer is not None
            admitted = []
            for event in KV_EVENTS_RING.decode_many(frames):
                admitted += self.scheduler.kv_transfer.on_event(event)
            to_detokenizer += self._admit_pulled(admitted)
            await self._plan_next()
        elif entry is RESULTS_RING:
            read_at = time.monotonic()
            for result in RESULTS_RING.decode_many(frames):
                if isinstance(result, StepResult):
                    batch = self.scheduler.update(result)
                    self._step_times.on_result(result)
                else:  # WorkerFailed: its StepResult follows with the sequences that ran
                    self.log.error(
                        "step %d: the workers could not compute sequences %s: %s",
                        result.step_id,
                        result.seq_ids,
                        result.error,
                    )
                    error = result.error
                    if result.status == 500:
                        error = f"the model failed on this request: {error}"
                    failures = self.scheduler.fail(result.seq_ids, error, result.status)
                    to_detokenizer.extend(TOKENS_RING.encode(f) for f in failures)
                    continue
                # Start the next step before telling the detokenizer: the workers are idle now.
                plan = await self._plan_next()
                if plan is not None:
                    self._step_times.planned_after_result(plan.step_id, read_at, self._planned_at)
                to_detokenizer += self._frames(batch)
        else:  # SUBMIT_RING (from the tokenizer) or STOPS_RING (from the detokenizer)
            requests = SUBMIT_RING if entry is SUBMIT_RING else STOPS_RING
            for message in requests.decode_many(frames):
                to_detokenizer.extend(self._apply(message))
            await self._plan_next()
        # Holds first: a handoff in these tokens must never reach a puller before its hold.
        await self._send_kv_orders()
        self._send_disk_orders()
        if to_detokenizer:
            await self.send_many(TOKENS_RING, to_detokenizer)
        self._publish_report()

    async def on_stop(self) -> None:
        if self._kv_ticker is not None:
            self._kv_ticker.cancel()
        if self._disk is not None:
            self._disk_task.cancel()
            await asyncio.to_thread(self._disk.close)

    async def _tick_kv_transfer(self) -> None:
        """Expire KV holds and pulls past their deadlines (P/D)."""
        assert self.scheduler.kv_transfer is not None
        while True:
            await asyncio.sleep(KV_TICK_S)
            failures = self._admit_pulled(self.scheduler.kv_transfer.tick())
            await self._plan_next()
            await self._send_kv_orders()
            if failures:
                await self.send_many(TOKENS_RING, failures)
            self._publish_report()  # an expired hold changes the figures of an idle scheduler

    def _admit_pulled(self, submits: list[SubmitRequest]) -> list[bytes]:
        """Queue requests whose KV arrived or fell back; frames for the detokenizer."""
        failures = self.scheduler.admit_pulled(submits)
        return [TOKENS_RING.encode(failure) for failure in failures]

    async def _send_kv_orders(self) -> None:
        if self.scheduler.kv_transfer is not None:
            orders = self.scheduler.kv_transfer.take_orders()
            if orders:
                await self.send_all(KV_ORDERS_RING, orders)

    async def on_rings_swapped(self, peer: str, rings: list[str]) -> None:
        if PLAN_RING.name in rings or RESULTS_RING.name in rings:
            # The workers restarted: their sequences are gone (their KV too, unless it lives in
            # the run's segments), and the gateway is about to resubmit every unfinished request
            # under a new epoch. Keep none of the old epochs: rerunning them would recompute
            # what is about to be replaced, and run requests the gateway holds back while it
            # retries a crash suspect alone.
            self.scheduler.on_workers_restarted()
            self.scheduler.abort(self.scheduler.request_ids())
            await self._plan_next()

    def _apply(self, message: ToScheduler) -> list[bytes]:
        """Apply one inbound request message; what the detokenizer must learn of it."""
        if isinstance(message, StopSamples):
            self.scheduler.stop_samples(message)
            return []
        if isinstance(message, AbortRequests):
            self.scheduler.abort(message.request_ids)
            return [TOKENS_RING.encode(message)]
        if isinstance(message, RequestFailed):  # the tokenizer's: on its way to the gateway
            self.scheduler.abort([message.request_id])
            return [TOKENS_RING.encode(message)]
        try:
            rejected = self.scheduler.add(message)
        except Exception as exc:  # this request's doing or not, the others go on
            self.log.exception("could not take in request %s", message.request_id)
            self.scheduler.abort([message.request_id])
            error = f"the scheduler could not take in this request: {type(exc).__name__}: {exc}"
            rejected = failed(message.request_id, message.epoch, 500, error, "scheduler")
        if rejected is not None:
            return [TOKENS_RING.encode(rejected)]
        # The detokenizer learns stop strings and resume points ahead of any token (same ring).
        forwarded = TOKENS_RING.encode(text_start(message))
        if len(forwarded) > self._max_frame_bytes:  # it could never reach the detokenizer
            self.scheduler.abort([message.request_id])
            error = too_large_for_one_frame(len(forwarded), self._max_frame_bytes)
            rejected = failed(message.request_id, message.epoch, 400, error, "scheduler")
            return [TOKENS_RING.encode(rejected)]
        early = self.scheduler.take_outputs()
        return [forwarded, *(self._frames(early) if early is not None else [])]

    def _frames(self, batch: TokenBatch) -> list[bytes]:
        """A step's tokens for the detokenizer, in as many frames as they need."""
        if not batch.items:
            return []
        return encode_in_frames(
            TOKENS_RING.channel, TokenBatch, [batch.items], self._max_frame_bytes
        )

    async def _plan_next(self) -> StepPlan | None:
        plan = self.scheduler.schedule()
        if plan is not None:
            # Before the send: once written, the plan may reach a rank before send() returns.
            self._planned_at = time.monotonic()
            await self.send_to(PLAN_RING, plan)
        return plan

    def _publish_report(self) -> None:
        """At most one report per interval while busy; once idle, one as soon as anything
        changed since the last report (so the figures of a short burst are not left out)."""
        now = time.monotonic()
        if now - self._last_report < REPORT_INTERVAL_S and self.scheduler.has_unfinished_requests:
            return  # busy: the next report is due at the interval (no figures built per step)
        stats = msgspec.structs.replace(self.scheduler.stats(), **self._step_times.figures())
        if now - self._last_report < REPORT_INTERVAL_S and stats == self._reported_stats:
            return
        self._last_report = now
        self._reported_stats = stats
        report = SchedulerReport(stats, self.scheduler.request_statuses())
        frame = REPORTS_RING.encode(report)
        writer = self.rings.writer(REPORTS_RING.name)
        if len(frame) > writer.spec.max_frame_bytes:  # the figures still go; the listing not
            frame = REPORTS_RING.encode(SchedulerReport(report.stats, []))
        # Never waits: a report the root has no room for is replaced by the next one.
        writer.try_send_many([frame])
