"""Deterministic mode: a stream resumed after any actor's death is bit-identical to the
undisturbed one, token ids and logprobs both (issue 17, item 6).

In the default mode a resumed stream re-prefills prompt + delivered tokens where the undisturbed
run decoded them: equal tokens but for near-ties, logprobs equal to the last few bits. With
`model.deterministic` the forward is batch-invariant, so they are equal to the bit.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import pytest_asyncio

from engine import AsyncLLM, Logprob, SamplingParams
from engine.library.llm import build_settings
from tests.checkpoints import tiny_checkpoint
from tests.integration.test_fault_tolerance import actor, wait_for
from tests.ipc_files import ipc_files

pytestmark = pytest.mark.asyncio(loop_scope="module")

STREAMS = 8
MAX_TOKENS = 120
WAIT_S = 180.0


@dataclass(frozen=True)
class Stream:
    token_ids: list[int]
    logprobs: list[Logprob]


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    """Restarted actors get fresh segments while the module's engine lives; checked at its end."""
    yield


def jobs() -> list[tuple[str, SamplingParams]]:
    """Greedy and seeded streams, each with its two most likely tokens' logprobs."""
    found = []
    for i in range(STREAMS):
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2, temperature=0)
        if i % 2:
            params.temperature, params.top_p, params.seed = 0.8, 0.9, 2000 + i
        found.append((f"stream {i} begins", params))
    return found


async def run(engine: AsyncLLM, progress: list[int]) -> list[Stream]:
    async def one(slot: int, prompt: str, params: SamplingParams) -> Stream:
        tokens: list[int] = []
        logprobs: list[Logprob] = []
        async for delta in engine.stream(prompt, params):
            for output in delta.outputs:
                tokens += output.token_ids
                logprobs += output.logprobs or []
            progress[slot] = len(tokens)
        return Stream(tokens, logprobs)

    runs = (one(slot, prompt, params) for slot, (prompt, params) in enumerate(jobs()))
    return list(await asyncio.wait_for(asyncio.gather(*runs), WAIT_S))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[tuple[AsyncLLM, list[Stream]]]:
    settings = build_settings(
        **{
            "model.path": str(tiny_checkpoint(arch="qwen3")),
            "model.max_model_len": 512,
            "model.deterministic": True,
            "cache.kv_cache_memory": 4 * 2**20,
            "runtime.restart_intensity": 100,
        }
    )
    before = ipc_files()
    engine = AsyncLLM(settings)
    try:
        await engine.start()
        yield engine, await run(engine, [0] * STREAMS)
    finally:
        await engine.shutdown()
    assert sorted(ipc_files() - before) == []


async def test_the_undisturbed_run_has_every_token_and_logprob(
    engine: tuple[AsyncLLM, list[Stream]],
) -> None:
    _, reference = engine
    assert all(len(s.token_ids) == len(s.logprobs) == MAX_TOKENS for s in reference)
    assert [lp.token_id for lp in reference[0].logprobs] == reference[0].token_ids


@pytest.mark.parametrize("victim", ["tokenizer", "scheduler", "worker0", "detokenizer"])
async def test_a_stream_resumed_after_a_kill_is_bit_identical(
    engine: tuple[AsyncLLM, list[Stream]], victim: str
) -> None:
    llm, reference = engine
    before = actor(llm, victim)
    progress = [0] * STREAMS
    streams = asyncio.ensure_future(run(llm, progress))
    try:
        # Past 32 tokens, a re-prefill takes the default kernels' long-chunk path (SDPA), whose
        # reduction order differs from decoding's: the default mode's logprobs differ there.
        await wait_for(lambda: min(progress) >= 40, "every stream under way")
        os.kill(before.pid, signal.SIGKILL)
        outcomes = await streams
    finally:
        streams.cancel()
    assert actor(llm, victim).restarts == before.restarts + 1
    for got, expected in zip(outcomes, reference, strict=True):
        assert got.token_ids == expected.token_ids
        assert got.logprobs == expected.logprobs  # floats compared exactly
