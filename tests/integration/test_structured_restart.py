"""A constrained request survives the crash of the worker, scheduler or detokenizer (issue 15):
its matcher is rebuilt on worker rank 0 from the tokens already delivered, so the completed
output equals the undisturbed run and still satisfies the constraint."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from engine import AsyncLLM, SamplingParams
from engine.library.llm import build_settings
from engine.messages.params import StructuredOutputsParams
from tests.checkpoints import tiny_checkpoint
from tests.holds import HOLD_TEXT, holding
from tests.ipc_files import ipc_files

pytestmark = pytest.mark.asyncio(loop_scope="module")

WAIT_S = 180.0
ANIMALS = r"(cat|dog|bird)( (cat|dog|bird)){59}"
# Held (tests/holds.py): 20 ms a token on any machine, so the constrained stream is still running,
# with seconds to go, when its 30th token triggers the kill.
CONSTRAINED_PROMPT = "Animals:" + HOLD_TEXT
CONSTRAINED = SamplingParams(
    max_tokens=400, temperature=0.0, structured_outputs=StructuredOutputsParams(regex=ANIMALS)
)
LOAD = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    """Replaces the suite's per-test check: the restarted worker's rings live as long as the
    module's engine; the engine fixture checks that none is left after its shutdown."""
    yield


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[AsyncLLM]:
    before = ipc_files()
    settings = build_settings(
        **{
            "model.path": str(tiny_checkpoint(arch="qwen3")),
            "model.max_model_len": 512,
            "cache.kv_cache_memory": 4 * 2**20,
            "runtime.heartbeat_interval": 0.5,
            "runtime.heartbeat_timeout": 4.0,
        }
    )
    with holding():  # for as long as the engine runs: restarted workers are spawned with it
        llm = AsyncLLM(settings)
        try:
            await llm.start()
            yield llm
        finally:
            await llm.shutdown()
    left = ipc_files() - before
    assert not left, f"segments or doorbells left after shutdown: {sorted(left)}"


async def run(engine: AsyncLLM, prompt: str, params: SamplingParams, progress: list[int]) -> str:
    text = ""
    async for delta in engine.stream(prompt, params):
        for output in delta.outputs:
            text += output.text
            progress[0] += len(output.token_ids)
    return text


async def workload(engine: AsyncLLM, victim: str | None, kill_after: int = 30) -> list[str]:
    progress = [[0] for _ in range(4)]
    jobs = [run(engine, CONSTRAINED_PROMPT, CONSTRAINED, progress[0])]
    jobs += [run(engine, f"load {i}", LOAD, progress[i]) for i in range(1, 4)]
    runs = asyncio.ensure_future(asyncio.gather(*jobs))
    try:
        if victim is not None:
            deadline = asyncio.get_running_loop().time() + WAIT_S
            while progress[0][0] < kill_after:
                assert asyncio.get_running_loop().time() < deadline, "the stream never started"
                await asyncio.sleep(0.005)
            pid = next(row.pid for row in engine.actors() if row.name == victim)
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
        return list(await asyncio.wait_for(runs, WAIT_S))
    finally:
        runs.cancel()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def undisturbed(engine: AsyncLLM) -> list[str]:
    outputs = await workload(engine, victim=None)
    assert re.fullmatch(ANIMALS, outputs[0])
    return outputs


@pytest.mark.parametrize("victim", ["worker0", "scheduler", "detokenizer"])
async def test_a_constrained_stream_completes_as_if_undisturbed_after_a_kill(
    engine: AsyncLLM, undisturbed: list[str], victim: str
) -> None:
    restarts = next(row.restarts for row in engine.actors() if row.name == victim)
    disturbed = await workload(engine, victim)
    assert next(row.restarts for row in engine.actors() if row.name == victim) > restarts
    assert disturbed == undisturbed
    assert re.fullmatch(ANIMALS, disturbed[0])
