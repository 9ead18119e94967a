"""A draft model through the whole actor system: the worker that runs it is SIGKILLed mid-stream,
restarts with a fresh draft, and the resubmitted request resumes exactly: the greedy tokens of
transformers' generate on the same checkpoint, every proposal accepted before and after."""

from __future__ import annotations

import asyncio
import json
import os
import signal

from engine import AsyncLLM, SamplingParams
from engine.api.llm import build_settings
from tests.checkpoints import assert_same_greedy, hf_greedy, tiny_checkpoint

MAX_TOKENS = 36
WAIT_S = 120


async def test_a_worker_killed_mid_stream_resumes_the_speculative_stream_exactly() -> None:
    path = tiny_checkpoint("qwen3")
    spec = json.dumps({"model": str(path), "num_speculative_tokens": 3})
    # No spare processes: on a small machine their imports slow this one launch down.
    fields = {"model.path": str(path), "scheduler.speculative_config": spec}
    settings = build_settings(None, **fields, **{"runtime.spare_processes": False})
    engine = AsyncLLM(settings)
    prompt = [11, 42, 97, 5, 300, 17, 64, 23] * 3
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        await asyncio.wait_for(engine.start(), WAIT_S)
        before = next(row for row in engine.actors() if row.name == "worker0")
        assert before.pid is not None
        victim = before.pid
        tokens: list[int] = []

        async def run() -> None:
            killed = False
            async for out in engine.stream(prompt={"prompt_token_ids": prompt}, params=params):
                tokens.extend(out.outputs[0].token_ids if out.outputs else [])
                if not killed and len(tokens) >= MAX_TOKENS // 3:
                    os.kill(victim, signal.SIGKILL)
                    killed = True

        await asyncio.wait_for(run(), WAIT_S)
        after = next(row for row in engine.actors() if row.name == "worker0")
        assert after.restarts == before.restarts + 1 and "SIGKILL" in after.last_restart_reason
        assert engine.gateway.resubmissions >= 1
        stats = engine.stats()
    finally:
        await engine.shutdown()
    assert len(tokens) == MAX_TOKENS
    assert_same_greedy(tokens, hf_greedy(path, prompt, MAX_TOKENS))
    # The restarted worker's draft caught up with prompt and delivered tokens: still all accepted.
    assert stats.spec_decode_num_draft_tokens > MAX_TOKENS // 2
    assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens
