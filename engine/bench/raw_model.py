"""The raw model's timing pieces, shared by tools/bench/one_batch.py and
tools/bench/parallel_batch.py: static batches prefilled in one step and decoded step by step on a
ModelRunner (no scheduler, no processes), with their block tables, random prompts and the greedy
pick.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from engine.model.runner import ModelRunner
from engine.model.step_inputs import SeqChunk


@dataclasses.dataclass
class CaseResult:
    batch_size: int
    input_len: int
    output_len: int
    prefill_seconds: float
    decode_step_seconds: float  # median over the decode steps
    # A mixture of experts: the experts each MoE layer ran per decode step, on average.
    experts_per_decode_step: float | None = None

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.batch_size * self.input_len / self.prefill_seconds

    @property
    def decode_tokens_per_second(self) -> float:
        return self.batch_size / self.decode_step_seconds

    @property
    def total_seconds(self) -> float:
        return self.prefill_seconds + (self.output_len - 1) * self.decode_step_seconds


def blocks_per_sequence(runner: ModelRunner, num_tokens: int) -> int:
    return -(-num_tokens // runner.block_size)


def fits(runner: ModelRunner, batch_size: int, num_tokens: int) -> str | None:
    """Why a static batch cannot run, or None when it can."""
    if num_tokens > runner.config.max_model_len:
        return f"{num_tokens} tokens exceed max_model_len {runner.config.max_model_len}"
    needed = batch_size * blocks_per_sequence(runner, num_tokens)
    if needed > runner.num_blocks:
        return f"needs {needed} KV blocks, the cache has {runner.num_blocks}"
    return None


def static_block_tables(runner: ModelRunner, batch_size: int, num_tokens: int) -> list[list[int]]:
    """Disjoint block ranges, one per sequence."""
    per_seq = blocks_per_sequence(runner, num_tokens)
    return [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch_size)]


def random_prompts(runner: ModelRunner, batch_size: int, input_len: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, runner.config.vocab_size, (batch_size, input_len), generator=generator)
    return ids.tolist()


# How a step's logits become next tokens: greedy here; tensor-parallel ranks pass one that
# shares rank 0's pick (tools/bench/parallel_batch.py).
Pick = Callable[[torch.Tensor], list[int]]


def greedy_pick(runner: ModelRunner) -> Pick:
    """Greedy tokens by the runner's kernel backend, as the engine's sampler picks them."""
    return lambda logits: runner.backend.argmax_rows(logits).tolist()


def prefill_batch(
    runner: ModelRunner,
    prompts: Sequence[list[int]],
    tables: Sequence[list[int]],
    pick: Pick | None = None,
) -> tuple[list[int], float]:
    """Prefill every prompt in one step; (greedy next tokens, seconds)."""
    chunks = [
        SeqChunk(i, p, 0, t, True) for i, (p, t) in enumerate(zip(prompts, tables, strict=True))
    ]
    pick = pick or greedy_pick(runner)
    start = time.perf_counter()
    logits = runner.forward(chunks)
    next_tokens = pick(logits)
    return next_tokens, time.perf_counter() - start


def decode_steps(
    runner: ModelRunner,
    tokens: list[int],
    context_len: int,
    tables: Sequence[list[int]],
    steps: int,
    pick: Pick | None = None,
) -> tuple[list[list[int]], list[float]]:
    """Greedy-decode `steps` steps from `tokens` at position context_len; (tokens, step seconds)."""
    pick = pick or greedy_pick(runner)
    generated: list[list[int]] = [[t] for t in tokens]
    seconds = []
    for step in range(steps):
        chunks = [
            SeqChunk(i, [generated[i][-1]], context_len + step, table, True)
            for i, table in enumerate(tables)
        ]
        start = time.perf_counter()
        next_tokens = pick(runner.forward(chunks))
        seconds.append(time.perf_counter() - start)
        for seq, token in zip(generated, next_tokens, strict=True):
            seq.append(token)
    return generated, seconds


def raw_decode_step_seconds(runner: ModelRunner, batch: int, ctx_len: int, steps: int = 8) -> float:
    """Median seconds of one decode step of `batch` sequences whose context is `ctx_len` tokens
    (prefilled first, untimed). Raises ValueError when it does not fit the KV cache."""
    reason = fits(runner, batch, ctx_len + steps)
    if reason:
        raise ValueError(f"batch {batch} at context {ctx_len} does not fit: {reason}")
    tables = static_block_tables(runner, batch, ctx_len + steps)
    tokens, _ = prefill_batch(runner, random_prompts(runner, batch, ctx_len), tables)
    _, seconds = decode_steps(runner, tokens, ctx_len, tables, steps)
    return statistics.median(seconds)


def bench_case(
    runner: ModelRunner,
    batch_size: int,
    input_len: int,
    output_len: int,
    pick: Pick | None = None,
) -> CaseResult:
    tables = static_block_tables(runner, batch_size, input_len + output_len)
    tokens, prefill_seconds = prefill_batch(
        runner, random_prompts(runner, batch_size, input_len), tables, pick
    )
    before = experts_run(runner)
    _, seconds = decode_steps(runner, tokens, input_len, tables, max(output_len - 1, 1), pick)
    after = experts_run(runner)
    per_step = (after[0] - before[0]) / (after[1] - before[1]) if after[1] > before[1] else None
    return CaseResult(
        batch_size, input_len, output_len, prefill_seconds, statistics.median(seconds), per_step
    )


def experts_run(runner: ModelRunner) -> tuple[int, int]:
    """(experts run, layer steps) summed over the model's MoE layers so far ((0, 0): none)."""
    from engine.model.architectures.experts import SparseMoE

    layers = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    return sum(m.experts_run for m in layers), sum(m.steps for m in layers)
