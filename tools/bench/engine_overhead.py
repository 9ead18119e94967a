"""Decode step time through the full actor system, for bench_one_batch's overhead column.

A batch of `batch` greedy requests of `input_len` prompt tokens runs through AsyncLLM (tokenizer,
scheduler, worker and detokenizer processes, rings, gateway). Once every request has its first
token, all of them decode in lock-step; the time from then until the last token, divided by the
number of decode steps, is one decode step as a client sees it.
"""

from __future__ import annotations

import asyncio
import random
import time

from engine import AsyncLLM, SamplingParams
from engine.library.llm import build_settings


async def _engine_step_seconds(
    engine: AsyncLLM, batch: int, input_len: int, output_len: int, vocab: int
) -> float:
    rng = random.Random(batch * 1000 + input_len)
    prompts = [[rng.randrange(10, vocab) for _ in range(input_len)] for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)

    async def token_times(prompt: list[int]) -> list[float]:
        return [time.perf_counter() async for _ in engine.stream(prompt, params)]

    runs = await asyncio.gather(*(token_times(p) for p in prompts))
    all_started = max(times[0] for times in runs)  # every request has its first token
    all_done = max(times[-1] for times in runs)
    return (all_done - all_started) / (output_len - 1)


def engine_decode_step_seconds(
    model: str,
    cases: list[tuple[int, int]],
    output_len: int,
    kv_cache_memory: int,
    num_threads: int | None,
    model_settings: dict[str, object] | None = None,
) -> dict[tuple[int, int], float]:
    """Seconds per decode step through the actor system for each (batch, input_len) case.
    model_settings: more settings by dotted name (the raw run's device, dtype, kernels)."""
    from engine.model.config import load_model_config

    vocab = load_model_config(model).vocab_size
    settings = build_settings(
        **{
            "model.path": model,
            "cache.kv_cache_memory": kv_cache_memory,
            "scheduler.max_num_seqs": max(batch for batch, _ in cases),
            "runtime.worker_threads": num_threads or 0,
            **(model_settings or {}),
        }
    )

    async def measure() -> dict[tuple[int, int], float]:
        async with AsyncLLM(settings) as engine:
            await _engine_step_seconds(engine, 2, 16, 4, vocab)  # warm-up
            return {
                (batch, input_len): await _engine_step_seconds(
                    engine, batch, input_len, output_len, vocab
                )
                for batch, input_len in cases
            }

    return asyncio.run(measure())
