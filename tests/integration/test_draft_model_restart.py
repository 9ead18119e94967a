"""A draft model through the whole actor system: the worker that runs it is SIGKILLed mid-stream,
restarts with a fresh draft, and the resubmitted requests resume exactly: a greedy one gives the
tokens of transformers' generate on the same checkpoint, a sampled seeded one beside it those of
the engine's step loop without speculation, every proposal accepted before and after."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from pathlib import Path

from engine import AsyncLLM, SamplingParams
from engine.library.llm import build_settings
from engine.model.runner import ModelRunner
from engine.model.step import StepExecutor
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.scheduler import Scheduler
from tests.checkpoints import assert_same_greedy, hf_greedy, tiny_checkpoint
from tests.holds import held, holding
from tests.speculation_runs import run_to_end

MAX_TOKENS = 48
WAIT_S = 120
SEED = 1234


async def test_a_worker_killed_mid_stream_resumes_the_speculative_stream_exactly() -> None:
    path = tiny_checkpoint("qwen3")
    spec = json.dumps({"model": str(path), "num_speculative_tokens": 3})
    # No spare processes: on a small machine their imports slow this one launch down.
    fields = {"model.path": str(path), "scheduler.speculative_config": spec}
    settings = build_settings(None, **fields, **{"runtime.spare_processes": False})
    engine = AsyncLLM(settings)
    # Held (tests/holds.py): each step lasts 20 ms on any machine, so the stream killed at a
    # third of its tokens still has 8 steps (of 4 tokens) to go.
    prompt = held([11, 42, 97, 5, 300, 17, 64, 23] * 3)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, seed=SEED, max_tokens=MAX_TOKENS, ignore_eos=True)
    with holding():  # for as long as the engine runs: the restarted worker too
        try:
            await asyncio.wait_for(engine.start(), WAIT_S)
            before = next(row for row in engine.actors() if row.name == "worker0")
            assert before.pid is not None
            victim = before.pid
            tokens: list[int] = []
            drawn: list[int] = []

            async def run() -> None:
                killed = False
                async for out in engine.stream(prompt={"prompt_token_ids": prompt}, params=params):
                    tokens.extend(out.outputs[0].token_ids if out.outputs else [])
                    if not killed and len(tokens) >= MAX_TOKENS // 3:
                        os.kill(victim, signal.SIGKILL)
                        killed = True

            async def run_sampled() -> None:
                async for out in engine.stream(prompt={"prompt_token_ids": prompt}, params=sampled):
                    drawn.extend(out.outputs[0].token_ids if out.outputs else [])

            await asyncio.wait_for(asyncio.gather(run(), run_sampled()), WAIT_S)
            after = next(row for row in engine.actors() if row.name == "worker0")
            assert after.restarts == before.restarts + 1 and "SIGKILL" in after.last_restart_reason
            assert engine.gateway.resubmissions >= 1
            stats = engine.stats()
        finally:
            await engine.shutdown()
    assert len(tokens) == MAX_TOKENS
    assert_same_greedy(tokens, hf_greedy(path, prompt, MAX_TOKENS))
    assert drawn == plain_tokens(path, prompt, sampled)
    # The restarted worker's draft caught up with prompt and delivered tokens: still all accepted.
    assert stats.spec_decode_num_draft_tokens > MAX_TOKENS // 2
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def plain_tokens(path: Path, prompt: list[int], params: SamplingParams) -> list[int]:
    """The request's tokens from the scheduler and step executor in this process, without
    speculation (sampling is a function of the seed and the position)."""
    runner = ModelRunner(str(path), kv_cache_memory=1 << 21)
    config = SchedulerConfig(
        num_blocks=runner.num_blocks, block_size=runner.block_size, max_model_len=256
    )
    request = {"sampled": (prompt, params)}
    executor = StepExecutor(runner, 0)
    return run_to_end(Scheduler(config), executor, request, {"sampled": SEED})["sampled"]
