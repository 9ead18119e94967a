"""The engine at its limits: a KV cache far too small for the load preempts and never crashes;
past the restart intensity it gives up in order, and says why.

One engine with a tiny KV cache (40 blocks) and a restart intensity of 1 serves both tests; the
second one ends it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from engine import AsyncLLM, EngineError, SamplingParams
from engine.library.llm import build_settings
from tests.checkpoints import tiny_checkpoint
from tests.holds import HOLD_TEXT, holding
from tests.integration.test_fault_tolerance import (
    Job,
    actor,
    alive,
    children_of,
    children_started_since,
    run_all,
    wait_for,
)
from tests.ipc_files import ipc_files

pytestmark = pytest.mark.asyncio(loop_scope="module")

BLOCK_BYTES = 8192  # the tiny qwen3 checkpoint: 2 layers x K,V x 2 heads x 16 dims x fp32 x 16
KV_BLOCKS = 40
STREAMS = 16
MAX_TOKENS = 200  # a stream needs ~14 blocks: at most 2-3 fit at once


def greedy_jobs(count: int, hold: str = "") -> list[Job]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
    return [Job(f"story {i} begins like this{hold}", params) for i in range(count)]


@pytest.fixture(scope="module")
def children_before() -> set[int]:
    """This process's children before the engine starts."""
    return set(children_of(os.getpid()))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(children_before: set[int]) -> AsyncIterator[AsyncLLM]:
    settings = build_settings(
        **{
            "model.path": str(tiny_checkpoint(arch="qwen3")),
            "model.max_model_len": 256,
            "cache.kv_cache_memory": KV_BLOCKS * BLOCK_BYTES,
            "runtime.restart_intensity": 1,
            "runtime.restart_period": 600.0,
        }
    )
    with holding():  # for as long as the engine runs: restarted workers are spawned with it
        engine = AsyncLLM(settings)
        try:
            await engine.start()
            assert engine.stats().kv_cache_blocks == KV_BLOCKS
            yield engine
        finally:
            await engine.shutdown()


async def test_kv_exhaustion_preempts_and_every_request_completes_unchanged(
    engine: AsyncLLM,
) -> None:
    jobs = greedy_jobs(STREAMS)
    alone = []  # two at a time: they fit, nothing is preempted
    for first in range(0, STREAMS, 2):
        alone += await run_all(engine, jobs[first : first + 2], [0, 0])
    preempted_before = engine.stats().num_preemptions
    together = await run_all(engine, jobs, [0] * STREAMS)
    assert together == alone
    assert all(len(o.token_ids) == MAX_TOKENS and o.error is None for o in together)
    stats = engine.stats()
    assert stats.num_preemptions > preempted_before
    assert sum(stats.restarts.values()) == 0
    await wait_for(
        lambda: engine.stats().num_free_blocks == KV_BLOCKS, "every block back", timeout=30
    )


async def test_past_the_restart_intensity_everything_fails_with_the_reason_and_stops(
    engine: AsyncLLM, children_before: set[int]
) -> None:
    jobs = greedy_jobs(8, hold=HOLD_TEXT)  # 4 s each on any machine: in flight when it gives up
    progress = [0] * len(jobs)
    streams = asyncio.ensure_future(run_all(engine, jobs, progress))
    await wait_for(lambda: max(progress) > 0, "tokens flowing")
    pids = {row.pid for row in engine.actors()}
    first = actor(engine, "scheduler")
    os.kill(first.pid, signal.SIGKILL)  # restart 1 of 1 allowed
    await wait_for(
        lambda: (  # a dead process's row has no pid until the supervisor has seen it go
            actor(engine, "scheduler").state == "running"
            and actor(engine, "scheduler").pid not in (None, first.pid)
        ),
        "the scheduler back",
    )
    assert engine.health().ready
    second = actor(engine, "scheduler").pid
    pids.add(second)
    os.kill(second, signal.SIGKILL)  # one too many

    reason = await asyncio.wait_for(engine.wait_closed(), 120)
    assert "restart intensity" in reason
    outcomes = await asyncio.wait_for(streams, 60)  # errors, not hangs
    failed = [o.error for o in outcomes if o.error is not None]
    assert failed and all(e.status == 503 and "restart intensity" in e.message for e in failed)
    health = engine.health()
    assert not health.ready and "restart intensity" in health.reason
    with pytest.raises(EngineError) as refused:
        await engine.complete("anyone there?", SamplingParams(max_tokens=4))
    assert refused.value.status == 503 and "restart intensity" in refused.value.message
    # In order: every actor stopped, every segment removed, before anyone called shutdown().
    assert all(row.pid is None for row in engine.actors())
    assert [pid for pid in pids if alive(pid)] == []
    assert children_started_since(children_before) == []
    assert ipc_files() == set()
    await asyncio.wait_for(engine.shutdown(), 60)
