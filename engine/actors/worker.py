"""A worker rank: a thin shell around a StepExecutor (engine/model/step.py).

Every rank reads the same broadcast StepPlan; rank 0 also samples and returns the one
StepResult of the step. Long steps run off the event loop, so that control messages keep
flowing during them; every step runs inside `busy()`, so heartbeats go on however long a
legitimate step takes (a stopped process still stops beating, and a collective that a peer never
joins fails after the group's collective timeout). When the scheduler restarts, its plans start
over: the ranks forget every sequence and the new scheduler announces them again.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
from tqdm import tqdm

from engine.actors.configs import WorkerConfig
from engine.messages.parallel import RENDEZVOUS
from engine.messages.ring_catalogue import PLAN_RING, RESULTS_RING
from engine.messages.roles import Role
from engine.messages.steps import STEP_PLANS, StepPlan, StepResult, WorkerFailed
from engine.model.placement.policy import sleeping_openmp_threads
from engine.model.step_inputs import is_long, step_tokens
from engine.runtime.actor import Actor
from engine.runtime.hooks import install_hooks
from engine.runtime.work_rate import WorkRate
from engine.structured.grammars import COMPILE_TIMEOUT_S

if TYPE_CHECKING:
    from engine.model.step import StepFaults


class WorkerActor(Actor):
    channels = (STEP_PLANS, RENDEZVOUS)  # the rendezvous: ranks > 0 read it while starting
    role = Role.WORKER
    # A test's step faults, installed by its hook (engine/runtime/hooks.py); None: none, and
    # steps pay nothing for them.
    step_faults: StepFaults | None = None

    @classmethod
    def preload(cls) -> None:
        """torch and the model's modules: most of a worker's start before its weights."""
        sleeping_openmp_threads()  # before torch is imported
        import engine.model.runner
        import engine.model.step  # noqa: F401

    async def on_start(self) -> dict[str, Any] | None:
        sleeping_openmp_threads()  # before torch is imported, below
        # tqdm's default lock is a multiprocessing semaphore, which a SIGKILLed worker would
        # leak (and the resource tracker warn about); a thread lock is all one process needs.
        tqdm.set_lock(threading.RLock())
        # torch only here: the other actors never pay for importing it.
        from engine.model.runner import ModelRunner
        from engine.model.step import StepExecutor

        config = msgspec.msgpack.decode(self.config, type=WorkerConfig)
        if config.engine_home:  # engine/kernels/cpu/build.py keeps the kernel there
            os.environ["ENGINE_HOME"] = config.engine_home
        group = None
        if config.tensor_parallel is not None:  # a rank of a group: join it first
            from engine.actors.tp_group import join_group_of

            config, group = await join_group_of(self, config)
        self.rank = config.rank
        install_hooks("worker", self)  # a test's step faults, if it asked for some
        cache_buffer = None
        if config.kv_cache_segment:
            from engine.runtime.segments import map_segment

            cache_buffer = map_segment(self.segments[config.kv_cache_segment])
        runner = ModelRunner(
            config.model_path,
            dtype=config.dtype,
            device=config.device,
            block_size=config.block_size,
            kv_cache_memory=config.kv_cache_memory,
            kv_cache_dtype=config.kv_cache_dtype,
            max_model_len=config.max_model_len,
            num_threads=config.num_threads,
            busy_threads=config.busy_threads,
            kernel_backend=config.kernel_backend,
            quantization=config.quantization,
            tensor_parallel=group,
            kv_cache_buffer=cache_buffer,
            # Our restarts map the weights this start read, kept in the root's run directory.
            weights_of_run=self.run_dir or None,
            max_lora_rank=config.max_lora_rank,
            max_cpu_loras=config.max_cpu_loras,
        )
        self.weight_slot = runner.weight_slot
        drafter = _drafter(config, runner, self.run_dir or None)
        self.draft_weight_slot = None if drafter is None else drafter.runner.weight_slot
        self.executor = StepExecutor(runner, config.rank, self.step_faults, drafter)
        # Each step's deadline: from its tokens and the rate measured on earlier steps, never
        # under the wait for a grammar (tensor-parallel peers wait for rank 0's in the step).
        self.step_rate = WorkRate(floor=COMPILE_TIMEOUT_S)
        self._scheduler_generation = 0  # bumped when the scheduler restarts (fresh plan ring)
        self.sequences_generation = 0  # the scheduler generation our sequences belong to
        return {"num_blocks": runner.num_blocks}

    async def on_stop(self) -> None:
        # Stopped in order: at shutdown, or with its group; the next start reads the checkpoint.
        # A killed worker leaves the segment to its successor (or the next run's sweep).
        for slot in (self.weight_slot, self.draft_weight_slot):
            if slot is not None:
                slot.remove()

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        generation = self._scheduler_generation
        for plan in PLAN_RING.decode_many(frames):  # its one ring served by handle()
            if generation != self._scheduler_generation:
                return  # the scheduler restarted meanwhile: the rest is a dead one's plans
            if self.sequences_generation != generation:
                self.executor.reset_sequences()  # the new scheduler announces them again
                self.sequences_generation = generation
            await self._grammars_compiled(plan)
            started_at = time.monotonic()
            if is_long(plan):
                messages = await asyncio.to_thread(self.run_step, plan)
            else:
                messages = self.run_step(plan)
            finished_at = time.monotonic()
            self.step_rate.observe(step_tokens(plan), finished_at - started_at)
            if messages and self.rank == 0 and generation == self._scheduler_generation:
                for message in messages:
                    if isinstance(message, StepResult):  # the scheduler's StepTimes read these
                        message.started_at, message.finished_at = started_at, finished_at
                await self.send_all(RESULTS_RING, messages)

    def run_step(self, plan: StepPlan) -> list[StepResult | WorkerFailed]:
        with self.busy(self.step_rate.deadline(step_tokens(plan))):  # the root judges by it
            return self.executor.run(plan)

    async def _grammars_compiled(self, plan: StepPlan) -> None:
        """Wait for the grammars the plan's new requests need here, on the event loop, and not
        inside the step, whose deadline is for the model's work alone."""
        compiling = [asyncio.wrap_future(future) for future in self.executor.compiling(plan)]
        if compiling:
            await asyncio.wait(compiling, timeout=COMPILE_TIMEOUT_S)

    async def on_rings_swapped(self, peer: str, rings: list[str]) -> None:
        if PLAN_RING.name in rings:  # the scheduler restarted; a running step: handle() resets
            self._scheduler_generation += 1


def _drafter(config: WorkerConfig, runner: Any, run_dir: str | None) -> Any:
    """Speculative decoding's draft model, on rank 0 (the launch allows it in groups of one)."""
    if not config.draft_model_path or config.rank != 0:
        return None
    from engine.model.speculation.drafter import Drafter

    return Drafter(
        config.draft_model_path,
        runner,
        dtype=config.dtype,
        kernel_backend=config.kernel_backend,
        num_threads=config.num_threads,
        busy_threads=config.busy_threads,
        rejection_sampling=config.draft_rejection_sampling,
        weights_of_run=run_dir,  # kept as the target's are (see on_start)
    )
