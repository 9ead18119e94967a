"""A failing tensor-parallel rank cannot hang its group (issue 17, item 2).

Each rank used to isolate a failing step on its own: a fault on one rank only made that rank
re-run the step's sequences one at a time, issuing collectives its peers never joined, and the
group waited for the 7-day collective timeout. Now the ranks agree on each step's outcome, and a
rank that never joins a collective makes it fail after the group's bounded collective timeout,
which restarts the group.

One TP=2 engine serves the module, with faults injected on one rank only (a test facility, see
engine/testing/fault_injection.py): a prompt holding token RAISE_ON[r] makes rank r alone fail
before the model runs; SAMPLE_FAILS makes rank 0's sampling fail; HANGS_RANK1 makes rank 1 sleep
past the collective timeout before joining the step.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio

from engine import AsyncLLM, SamplingParams
from engine.library.llm import build_settings
from engine.testing.fault_injection import FAULT_INJECTION_ENV, environment
from tests.checkpoints import tiny_checkpoint
from tests.environment import environment_set
from tests.integration.test_fault_tolerance import (
    Job,
    Outcome,
    actor,
    ipc_files,
    run_all,
    workload,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

RAISE_ON = {0: 401, 1: 402}
SAMPLE_FAILS = 403
HANGS_RANK1 = 404
COLLECTIVE_TIMEOUT_S = 2.0
FAULTS = (
    f"raise@0:{RAISE_ON[0]},raise@1:{RAISE_ON[1]},raise-late@0:{SAMPLE_FAILS},"
    f"sleep{COLLECTIVE_TIMEOUT_S * 3:g}@1:{HANGS_RANK1}"
)


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    """The module's engine owns segments until it closes; the fixture checks after that."""
    yield


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[AsyncLLM]:
    settings = build_settings(
        **{
            "model.path": str(tiny_checkpoint(arch="qwen3", num_kv_heads=2)),
            "model.max_model_len": 512,
            "cache.kv_cache_memory": 2**20,
            "parallel.tensor_parallel_size": 2,
            "parallel.collective_timeout": COLLECTIVE_TIMEOUT_S,
            "runtime.restart_intensity": 100,
            "runtime.quarantine_after": 2,
        }
    )
    before = ipc_files()
    with environment_set(environment(FAULT_INJECTION_ENV, FAULTS)):
        engine = AsyncLLM(settings)
        try:
            await engine.start()
            yield engine
        finally:
            await engine.shutdown()
    assert sorted(ipc_files() - before) == []


def poison(token: int) -> Job:
    return Job([11, 12, token, 13], SamplingParams(max_tokens=20, temperature=0.0))


def restarts(engine: AsyncLLM) -> list[int]:
    return [actor(engine, name).restarts for name in ("worker0", "worker1")]


async def run_beside_innocents(engine: AsyncLLM, bad: Job) -> tuple[list[Outcome], Outcome]:
    """Three innocent streams and `bad`, submitted together (so they share steps), and the
    innocents' undisturbed outcomes: (reference, the batch's outcomes)."""
    jobs = workload(3, max_tokens=30)
    reference = await run_all(engine, jobs, [0] * 3)
    outcomes = await run_all(engine, [*jobs, bad], [0] * 4)
    assert outcomes[:3] == reference  # the innocents did not notice
    return reference, outcomes[3]


@pytest.mark.parametrize(
    "token", [RAISE_ON[0], RAISE_ON[1], SAMPLE_FAILS], ids=["rank0", "rank1", "rank0-sampling"]
)
async def test_a_fault_on_one_rank_fails_only_its_request_and_the_group_goes_on(
    engine: AsyncLLM, token: int
) -> None:
    before = restarts(engine)
    _, outcome = await asyncio.wait_for(run_beside_innocents(engine, poison(token)), 120)
    error = outcome.error
    assert error is not None and error.status == 500, outcome
    if token == RAISE_ON[1]:  # rank 0 reports: it names the rank that failed
        assert "FailedOnAnotherRank" in error.message and "[1]" in error.message
    else:
        assert "InjectedFault" in error.message
    assert restarts(engine) == before  # isolated by both ranks together: no restart
    assert engine.health().ready


async def test_a_rank_that_never_joins_a_collective_restarts_the_group(engine: AsyncLLM) -> None:
    before = restarts(engine)
    _, outcome = await asyncio.wait_for(run_beside_innocents(engine, poison(HANGS_RANK1)), 180)
    # Every attempt hangs the group until the collective timeout: after quarantine_after
    # crashes the request fails alone, and the group serves on.
    error = outcome.error
    assert error is not None and error.status == 500 and "quarantined" in error.message
    after = restarts(engine)
    assert after[0] >= before[0] + 2 and after[1] >= before[1] + 2
    reason = actor(engine, "worker0").last_restart_reason
    assert "CollectiveError" in reason or "worker1" in reason, reason
    again = await engine.complete("after the hang", SamplingParams(max_tokens=5))
    assert again is not None and engine.health().ready
