"""A worker rank: owns a model replica's weights (its shard) and KV cache, runs each StepPlan.

Every rank reads the same broadcast StepPlan; rank 0 also samples and returns the one
StepResult of the step. The domain work is ModelRunner (forward) and Sampler (tokens).

A step that raises does not take the worker down: it is run again one sequence at a time, the
sequences that fail alone are reported in a WorkerFailed (their requests fail with status 500)
and the StepResult carries the others. When every sequence fails alone too, or steps keep failing
with nothing succeeding in between, the fault is the worker's, not the requests': it crashes,
the supervisor restarts it and the gateway resubmits (and quarantines a request that keeps
crashing it).

Steps that compute many tokens (long prefills) run off the event loop, so that heartbeats and
control messages keep flowing during them: the heartbeat timeout need not exceed the longest
step. A process that is truly stuck (SIGSTOP, a deadlock in a short step) still stops beating.

Fault injection, a test facility: when the environment variable ENGINE_FAULT_INJECTION is set
(never by the engine itself; nothing a client sends can set it), a sequence whose prompt holds a
chosen token id misbehaves whenever one of its chunks runs. The value is a comma-separated list
of ACTION:TOKEN_ID with ACTION one of `raise` (the step raises, as a bug in the model code would)
and `exit` (the process ends at once with status 70, as a native crash would), e.g.
`raise:501,exit:502`.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
from tqdm import tqdm

from engine.actors.runtime.actor import Actor
from engine.messages.steps import (
    STEP_PLANS,
    STEP_RESULTS,
    StepPlan,
    StepResult,
    TokenLogprobs,
    WorkerFailed,
)
from engine.model.parallel.config import TensorParallelConfig
from engine.model.step_inputs import KnownSequences, SeqChunk, SequenceStart

FAULT_INJECTION_ENV = "ENGINE_FAULT_INJECTION"
FAULT_EXIT_STATUS = 70  # EX_SOFTWARE: what an injected native crash exits with
THREADED_STEP_TOKENS = 512  # steps computing more tokens run in a thread (heartbeats go on)
MAX_FAILED_STEPS = 3  # consecutive steps in which nothing succeeded: the worker is at fault


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
    tensor_parallel: TensorParallelConfig | None = None  # None: a group of one


class InjectedFault(RuntimeError):
    """Raised by fault injection (`raise:TOKEN_ID`); never seen unless a test asked for it."""


class FaultInjection:
    """Which sequences misbehave (see the module doc); empty unless a test configured it."""

    ACTIONS = ("raise", "exit")

    def __init__(self, spec: str = "") -> None:
        self.rules: dict[int, str] = {}  # token id -> action
        for part in filter(None, (p.strip() for p in spec.split(","))):
            action, _, token = part.partition(":")
            if action not in self.ACTIONS or not token.strip().isdigit():
                raise ValueError(
                    f"{FAULT_INJECTION_ENV} entry {part!r} must be ACTION:TOKEN_ID with ACTION "
                    f"one of {self.ACTIONS}, e.g. 'raise:501'"
                )
            self.rules[int(token)] = action
        self._armed: dict[int, str] = {}  # seq_id -> action

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> FaultInjection:
        return cls(environ.get(FAULT_INJECTION_ENV, ""))

    def watch(self, new_seq: SequenceStart) -> None:
        if self.rules:
            hits = [self.rules[t] for t in set(new_seq.prompt_token_ids) if t in self.rules]
            if hits:
                self._armed[new_seq.seq_id] = "exit" if "exit" in hits else "raise"

    def forget(self, seq_ids: Sequence[int]) -> None:
        if self._armed:
            for seq_id in seq_ids:
                self._armed.pop(seq_id, None)

    def reset(self) -> None:
        self._armed.clear()

    def trip(self, chunks: Sequence[SeqChunk]) -> None:
        """Misbehave if any of these chunks belongs to an armed sequence."""
        for chunk in chunks:
            action = self._armed.get(chunk.seq_id)
            if action == "exit":
                os._exit(FAULT_EXIT_STATUS)
            if action == "raise":
                raise InjectedFault(f"injected fault for sequence {chunk.seq_id}")


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

        config = msgspec.msgpack.decode(self.config, type=WorkerConfig)
        group = None
        if config.tensor_parallel is not None:  # a rank of a group: join it first
            from engine.actors.tensor_parallel import join_group_of

            config, group = await join_group_of(self, config)
        self.rank = config.rank
        self.faults = FaultInjection.from_environment(os.environ)
        if self.faults.rules:
            self.log.warning("fault injection is on: %s", self.faults.rules)
        self.runner = ModelRunner(
            config.model_path,
            dtype=config.dtype,
            device=config.device,
            block_size=config.block_size,
            kv_cache_memory=config.kv_cache_memory,
            max_model_len=config.max_model_len,
            seed=config.seed,
            num_threads=config.num_threads,
            tensor_parallel=group,
        )
        self._new_sampler()
        self._scheduler_generation = 0  # bumped when the scheduler restarts (fresh plan ring)
        self._sequences_generation = 0  # the scheduler generation our sequences belong to
        self._failed_steps = 0
        return {"num_blocks": self.runner.num_blocks}

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        generation = self._scheduler_generation
        for plan in STEP_PLANS.decode_many(frames):
            if generation != self._scheduler_generation:
                return  # the scheduler restarted meanwhile: the rest is a dead one's plans
            if self._sequences_generation != generation:
                self._new_sampler()  # the new scheduler announces every sequence again
                self._sequences_generation = generation
            if sum(len(chunk.token_ids) for chunk in plan.chunks) > THREADED_STEP_TOKENS:
                messages = await asyncio.to_thread(self.run_step, plan)
            else:
                messages = self.run_step(plan)
            if messages and self.rank == 0 and generation == self._scheduler_generation:
                await self.send_many("results", [STEP_RESULTS.encode(m) for m in messages])

    async def on_rings_swapped(self, peer: str, rings: list[str]) -> None:
        if "plan" in rings:  # the scheduler restarted; a step may be running: handle() resets
            self._scheduler_generation += 1

    def run_step(self, plan: StepPlan) -> list[StepResult | WorkerFailed]:
        """The step's messages for the scheduler: WorkerFailed for sequences that could not be
        computed (if any), then the StepResult (none for a plan that only retires sequences)."""
        self.sampler.remove(plan.finished_seq_ids)
        self.faults.forget(plan.finished_seq_ids)
        starts, whole_chunks = self.known.apply(plan)
        failed: dict[int, str] = {}
        for new_seq in starts:
            try:
                self.sampler.add(new_seq)
                self.faults.watch(new_seq)
            except Exception as exc:  # this sequence's parameters, not the step's
                failed[new_seq.seq_id] = _describe(exc)
        result = None
        if whole_chunks:
            chunks = [chunk for chunk in whole_chunks if chunk.seq_id not in failed]
            try:
                result = self._compute(plan.step_id, chunks)
            except Exception as exc:
                result = self._isolate(plan.step_id, chunks, exc, failed)
            computed = any(chunk.seq_id not in failed for chunk in chunks)
            self._failed_steps = self._failed_steps + 1 if failed and not computed else 0
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise RuntimeError(
                    f"{MAX_FAILED_STEPS} steps in a row failed with nothing computed; "
                    f"last: {next(iter(failed.values()))}"
                )
        messages: list[StepResult | WorkerFailed] = [
            WorkerFailed(plan.step_id, [seq_id], error) for seq_id, error in failed.items()
        ]
        if result is not None:
            messages.append(result)
        return messages

    def _compute(self, step_id: int, chunks: Sequence[SeqChunk]) -> StepResult:
        self.faults.trip(chunks)
        logits = self.runner.forward(chunks)
        if self.rank != 0:  # tensor parallelism: the logits, and sampling, are rank 0's
            return StepResult(step_id, [], [], None)
        seq_ids = [chunk.seq_id for chunk in chunks if chunk.sample]
        if not seq_ids:
            return StepResult(step_id, [], [], None)
        token_ids, logprobs = self.sampler.sample(seq_ids, logits)
        return StepResult(step_id, seq_ids, token_ids, logprobs)

    def _isolate(
        self,
        step_id: int,
        chunks: Sequence[SeqChunk],
        error: Exception,
        failed: dict[int, str],
    ) -> StepResult:
        """Run a failed step's chunks one at a time; those that fail alone go to `failed`.

        Rerunning is safe: a chunk writes the same KV slots with the same values again, and
        sampling is a function of (seed, position), so a sequence gets the token it would have.
        """
        self.log.warning(
            "step %d failed (%s): running its %d sequence(s) one at a time",
            step_id,
            _describe(error),
            len(chunks),
        )
        parts: list[StepResult] = []
        for chunk in chunks:
            try:
                parts.append(self._compute(step_id, [chunk]))
            except Exception as exc:
                failed[chunk.seq_id] = _describe(exc)
        if len(chunks) > 1 and not parts:
            raise error  # every sequence fails alone: the worker is broken, not the requests
        self.log.error("step %d: sequences %s failed alone: %s", step_id, sorted(failed), failed)
        return _merge(step_id, parts)

    def _new_sampler(self) -> None:
        from engine.model.sampler import Sampler

        config = self.runner.config
        self.sampler = Sampler(config.vocab_size, list(config.eos_token_ids))
        self.known = KnownSequences()
        self.faults.reset()


def _merge(step_id: int, parts: list[StepResult]) -> StepResult:
    """One StepResult from per-sequence ones (logprobs for all rows if any part has them)."""
    seq_ids = [seq_id for part in parts for seq_id in part.seq_ids]
    token_ids = [token_id for part in parts for token_id in part.token_ids]
    if all(part.logprobs is None for part in parts):
        return StepResult(step_id, seq_ids, token_ids, None)
    logprobs: list[TokenLogprobs] = []
    for part in parts:
        # Rows of sequences that did not ask for logprobs are never read: placeholders do.
        logprobs += part.logprobs or [TokenLogprobs(0.0, [], []) for _ in part.seq_ids]
    return StepResult(step_id, seq_ids, token_ids, logprobs)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
