"""The scheduler actor: a thin shell that feeds rings into `Scheduler` and its plans back out.

Inbound: requests from the tokenizer ("submit"), one StepResult per step from worker rank 0
("results"), stop-string stops from the detokenizer ("stops"). Outbound: one StepPlan per step to
every rank ("plan", broadcast), one TokenBatch per step to the detokenizer ("tokens"), and a
periodic report to the root ("reports"). Exactly one step is in flight at a time.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from engine.actors.runtime.actor import Actor
from engine.actors.scheduler.config import SchedulerConfig
from engine.actors.scheduler.scheduler import Scheduler
from engine.messages.reports import SCHEDULER_REPORTS, SchedulerReport
from engine.messages.scheduling import (
    SCHEDULER_OUTPUTS,
    SCHEDULER_REQUESTS,
    AbortRequests,
    StopSamples,
    SubmitRequest,
)
from engine.messages.steps import STEP_PLANS, STEP_RESULTS, StepResult

REPORT_INTERVAL_S = 0.2  # the admin socket's and /metrics' view may lag this much


class SchedulerActor(Actor):
    channels = (SCHEDULER_REQUESTS, STEP_RESULTS)

    async def on_start(self) -> dict[str, Any] | None:
        config = msgspec.msgpack.decode(self.config, type=SchedulerConfig)
        self.scheduler = Scheduler(config)
        self._last_report = 0.0
        self._reported_idle = False
        self._publish_report()  # so the root's stats are complete from the start
        return {"num_blocks": config.num_blocks}

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        to_detokenizer: list[bytes] = []
        if ring == "results":
            for message in STEP_RESULTS.decode_many(frames):
                if isinstance(message, StepResult):
                    batch = self.scheduler.update(message)
                else:  # WorkerFailed: a step crashed a rank; the rank restarts, we resubmit
                    self.log.error("step %d failed on a worker: %s", message.step_id, message.error)
                    continue
                # Start the next step before telling the detokenizer: the workers are idle now.
                await self._plan_next()
                if batch.items:
                    to_detokenizer.append(SCHEDULER_OUTPUTS.encode(batch))
        else:  # "submit" (from the tokenizer) or "stops" (from the detokenizer)
            for message in SCHEDULER_REQUESTS.decode_many(frames):
                to_detokenizer.extend(self._apply(message))
            await self._plan_next()
        if to_detokenizer:
            await self.send_many("tokens", to_detokenizer)
        self._publish_report()

    async def on_rings_swapped(self, peer: str, rings: list[str]) -> None:
        if "plan" in rings or "results" in rings:
            # The workers restarted: their KV cache and sequences are gone.
            self.scheduler.on_workers_restarted()
            await self._plan_next()

    def _apply(self, message: SubmitRequest | AbortRequests | StopSamples) -> list[bytes]:
        """Apply one inbound request message; what the detokenizer must learn of it."""
        if isinstance(message, StopSamples):
            self.scheduler.stop_samples(message)
            return []
        if isinstance(message, AbortRequests):
            self.scheduler.abort(message.request_ids)
            return [SCHEDULER_OUTPUTS.encode(message)]
        rejected = self.scheduler.add(message)
        if rejected is not None:
            return [SCHEDULER_OUTPUTS.encode(rejected)]
        # The detokenizer learns stop strings and resume points ahead of any token (same ring).
        out = [SCHEDULER_OUTPUTS.encode(message)]
        early = self.scheduler.take_outputs()
        if early is not None:
            out.append(SCHEDULER_OUTPUTS.encode(early))
        return out

    async def _plan_next(self) -> None:
        plan = self.scheduler.schedule()
        if plan is not None:
            await self.send("plan", STEP_PLANS.encode(plan))

    def _publish_report(self) -> None:
        now = time.monotonic()
        idle = not self.scheduler.has_unfinished_requests
        if now - self._last_report < REPORT_INTERVAL_S and not (idle and not self._reported_idle):
            return
        self._last_report = now
        self._reported_idle = idle
        report = SchedulerReport(self.scheduler.stats(), self.scheduler.request_statuses())
        # Never waits: a report the root has no room for is replaced by the next one.
        self.rings.writer("reports").try_send_many([SCHEDULER_REPORTS.encode(report)])
