"""A worker rank: owns a model replica's weights (its shard) and KV cache, runs each StepPlan.

Every rank reads the same broadcast StepPlan; rank 0 also samples and returns the one
StepResult of the step. The domain work is ModelRunner (forward) and Sampler (tokens).
"""

from __future__ import annotations

import os
import threading
from typing import Any

import msgspec
from tqdm import tqdm

from engine.actors.runtime.actor import Actor
from engine.messages.steps import STEP_PLANS, STEP_RESULTS, StepPlan, StepResult


class WorkerConfig(msgspec.Struct, frozen=True):
    model_path: str
    rank: int
    world_size: int
    dtype: str
    device: str
    block_size: int
    kv_cache_memory: int  # bytes; the root sized it to exactly the scheduler's block count
    max_model_len: int
    seed: int
    num_threads: int | None = None


class WorkerActor(Actor):
    channels = (STEP_PLANS,)

    async def on_start(self) -> dict[str, Any] | None:
        # With two OpenMP threads on a small machine, a spinning barrier thread fights the
        # scheduler and detokenizer for the other core; passive waiting is 5-10x faster here.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        # tqdm's default lock is a multiprocessing semaphore, which a SIGKILLed worker would
        # leak (and the resource tracker warn about); a thread lock is all one process needs.
        tqdm.set_lock(threading.RLock())
        # torch only here: the other actors never pay for importing it.
        from engine.model.runner import ModelRunner
        from engine.model.sampler import Sampler

        config = msgspec.msgpack.decode(self.config, type=WorkerConfig)
        self.rank = config.rank
        self.runner = ModelRunner(
            config.model_path,
            dtype=config.dtype,
            device=config.device,
            block_size=config.block_size,
            kv_cache_memory=config.kv_cache_memory,
            max_model_len=config.max_model_len,
            seed=config.seed,
            num_threads=config.num_threads,
        )
        self.sampler = Sampler(
            self.runner.config.vocab_size, list(self.runner.config.eos_token_ids)
        )
        return {"num_blocks": self.runner.num_blocks}

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        for plan in STEP_PLANS.decode_many(frames):
            result = self.run_step(plan)
            if result is not None and self.rank == 0:
                await self.send("results", STEP_RESULTS.encode(result))

    def run_step(self, plan: StepPlan) -> StepResult | None:
        self.sampler.remove(plan.finished_seq_ids)
        for new_seq in plan.new_seqs:
            self.sampler.add(new_seq)
        if not plan.chunks:
            return None  # a plan that only retires sequences expects no result
        logits = self.runner.forward(plan.chunks)
        seq_ids = [chunk.seq_id for chunk in plan.chunks if chunk.sample]
        if not seq_ids:
            return StepResult(plan.step_id, [], [], None)
        token_ids, logprobs = self.sampler.sample(seq_ids, logits)
        return StepResult(plan.step_id, seq_ids, token_ids, logprobs)
