"""Worker ranks of a tensor-parallel group that spans hosts: the plan relay.

Shared-memory rings do not leave a host, so a rank on another host cannot read the plan ring.
In a group that spans hosts only rank 0 reads it (`PlanRelayWorker`); before running each plan
it broadcasts the encoded plan over the group, and every other rank (`PlanFollowerWorker`)
receives it there and runs it: the same plans, in the same order, with the same sequence
resets, so the ranks' collectives line up.
"""

from __future__ import annotations

import asyncio
from typing import Any

from engine.actors.worker import WorkerActor
from engine.messages.parallel import RELAYED_PLANS, RelayedPlan
from engine.messages.steps import StepPlan, StepResult, WorkerFailed
from engine.model.step_inputs import is_long


class PlanRelayWorker(WorkerActor):
    """Rank 0 of a group that spans hosts: broadcasts each plan to the group, then runs it."""

    def run_step(self, plan: StepPlan) -> list[StepResult | WorkerFailed]:
        relayed = RelayedPlan(self.sequences_generation, plan)
        self.executor.runner.group.broadcast_frames([RELAYED_PLANS.encode(relayed)])
        return super().run_step(plan)


class PlanFollowerWorker(WorkerActor):
    """A rank > 0 of a group that spans hosts: runs the plans rank 0 broadcasts.

    It reads no ring; waiting for the next plan happens in a thread, so heartbeats and control
    messages go on while the engine is idle. When rank 0 goes away the broadcast fails and the
    follower stops, to be restarted by its own supervisor and join rank 0's next generation.
    """

    async def on_start(self) -> dict[str, Any] | None:
        info = await super().on_start()
        self._following = asyncio.get_running_loop().create_task(self._follow())
        self._following.add_done_callback(self._on_follow_done)
        return info

    async def on_stop(self) -> None:
        self._following.cancel()
        await super().on_stop()

    async def _follow(self) -> None:
        group = self.executor.runner.group
        while True:
            [frame] = await asyncio.to_thread(group.receive_frames)
            relayed = RELAYED_PLANS.decode(frame)
            if relayed.sequences_generation != self.sequences_generation:
                self.executor.reset_sequences()  # rank 0 met a restarted scheduler
                self.sequences_generation = relayed.sequences_generation
            plan = relayed.plan
            if is_long(plan):
                await asyncio.to_thread(self.run_step, plan)
            else:
                self.run_step(plan)

    def _on_follow_done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            error = task.exception()
            self.log.error("plan relay from rank 0 ended: %r", error)
            self.stop(f"plan relay from rank 0 ended: {error!r}")
