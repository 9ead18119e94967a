"""Data parallelism with real processes: two replicas (each a whole pipeline: tokenizer,
scheduler, detokenizer, worker) behind one gateway.

One engine (DP=2, module scope, one event loop) serves every test. The undisturbed workload of 8
concurrent streams, greedy and seeded, runs once at the start: its greedy outputs are judged
against transformers, and it is what every disturbed run must reproduce token for token. The
restart intensity is 1 per replica, so the first SIGKILL of replica 1's worker is restarted and
the second makes replica 1 give up; replica 0 serves on through both. The last test shuts the
engine down and checks that no process and no segment is left.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from engine import AsyncLLM, SamplingParams
from engine.library.llm import build_settings
from engine.messages.admin import Health
from tests.checkpoints import tiny_checkpoint
from tests.hf_reference import assert_greedy_matches_hf
from tests.holds import held, holding
from tests.integration.test_fault_tolerance import (
    alive,
    children_of,
    children_started_since,
    ipc_files,
    wait_for,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

STREAMS = 8
# The prompts are held (tests/holds.py): 20 ms a token on any machine, so a replica's requests
# are still in flight with seconds to go when its worker is killed after 10 tokens.
MAX_TOKENS = 80
PROMPT_LEN = 6
WAIT_S = 180.0  # any wait here; a restart takes seconds on a busy machine


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    params: SamplingParams

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0.0


@dataclass(frozen=True)
class Outcome:
    token_ids: list[int]
    text: str
    finish_reason: str | None


@dataclass
class Run:
    """One workload's outcomes, and the replica each request was routed to."""

    outcomes: list[Outcome]
    replicas: list[int | None]


def workload() -> list[Job]:
    """Equal-sized token-id prompts, so that the router alternates between idle replicas:
    streams 0, 1, 4, 5 are greedy and 2, 3, 6, 7 seeded, each pair landing on both replicas."""
    jobs = []
    for i in range(STREAMS):
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
        if i % 4 >= 2:
            params.temperature, params.top_p, params.seed = 0.9, 0.95, 500 + i
        jobs.append(Job(held([7 + 11 * i + k for k in range(PROMPT_LEN - 1)]), params))
    return jobs


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    """Replaces the suite's per-test check: a restarted worker gets fresh segments that live as
    long as the module's engine; the last test checks that none are left after shutdown."""
    yield


@dataclass
class Shared:
    engine: AsyncLLM
    path: str
    reference: Run
    ipc_before: set[Path]
    children_before: set[int]
    pids: set[int] = field(default_factory=set)

    def note_pids(self) -> None:
        self.pids.update(row.pid for row in self.engine.actors() if row.pid is not None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared() -> AsyncIterator[Shared]:
    path = str(tiny_checkpoint(arch="qwen3"))
    settings = build_settings(
        **{
            "model.path": path,
            "model.max_model_len": 512,
            "cache.kv_cache_memory": 2 * 2**20,
            "parallel.data_parallel_size": 2,
            "runtime.restart_intensity": 1,
            "runtime.restart_period": 3600.0,
            # Long enough for replica 0's worker to sit stopped while replica 1's restarts.
            "runtime.heartbeat_timeout": 120.0,
            "runtime.stopped_timeout": 120.0,
        }
    )
    ipc_before = ipc_files()
    children_before = set(children_of(os.getpid()))
    with holding():  # for as long as the engine runs: restarted workers are spawned with it
        engine = AsyncLLM(settings)
        try:
            await asyncio.wait_for(engine.start(), WAIT_S)
            reference = await run_workload(engine, [0] * STREAMS)
            state = Shared(engine, path, reference, ipc_before, children_before)
            state.note_pids()
            yield state
        finally:
            await asyncio.wait_for(engine.shutdown(), WAIT_S)


async def run_job(engine: AsyncLLM, job: Job, progress: list[int], slot: int) -> Outcome:
    tokens: list[int] = []
    text, finish = "", None
    async for delta in engine.stream(job.prompt, job.params):
        for output in delta.outputs:
            tokens += output.token_ids
            text += output.text
            finish = output.finish_reason or finish
        progress[slot] = len(tokens)
    return Outcome(tokens, text, finish)


async def run_workload(
    engine: AsyncLLM,
    progress: list[int],
    disturb: Callable[[], Awaitable[None]] | None = None,
    when: Callable[[list[int]], bool] = lambda progress: min(progress) >= 10,
) -> Run:
    """Run the workload; await `disturb()` once `when(progress)` holds. Notes where each request
    ran (engine.requests() names the replica while a request is in flight)."""
    jobs = workload()
    seen: dict[str, int | None] = {}

    async def watch() -> None:
        while True:
            seen.update({row.request_id: row.replica for row in engine.requests()})
            await asyncio.sleep(0.005)

    watcher = asyncio.ensure_future(watch())
    runs = asyncio.ensure_future(
        asyncio.gather(*(run_job(engine, job, progress, i) for i, job in enumerate(jobs)))
    )
    try:
        if disturb is not None:
            await wait_for(lambda: when(progress) or runs.done(), "the streams under way")
            assert not runs.done(), "the workload finished before it could be disturbed"
            await disturb()
        outcomes = await asyncio.wait_for(runs, WAIT_S)
    finally:
        runs.cancel()
        watcher.cancel()
    # Request ids are handed out in submission order, so sorting them gives the job order.
    ids = sorted(seen, key=lambda request_id: int(request_id.rsplit("-", 1)[1]))
    return Run(list(outcomes), [seen[request_id] for request_id in ids])


@dataclass
class Resubmitted:
    """What one resubmission did: which requests each replica had, and their epochs after."""

    on_replica: dict[int, list[str]] = field(default_factory=dict)
    epochs: dict[str, int] = field(default_factory=dict)
    count: int = 0


async def kill_replica_1_worker_with_replica_0_paused(engine: AsyncLLM, seen: Resubmitted) -> None:
    """SIGKILL replica 1's worker while replica 0's is stopped (SIGSTOP), so that replica 0's
    requests are surely still in flight when the engine resubmits after the death; note what
    the resubmission did, then let replica 0 go on."""
    workers = actors(engine)
    before = engine.gateway.resubmissions
    os.kill(workers["worker0-r0"].pid, signal.SIGSTOP)
    try:
        for row in engine.requests():
            seen.on_replica.setdefault(row.replica, []).append(row.request_id)
        os.kill(workers["worker0-r1"].pid, signal.SIGKILL)
        await wait_for(lambda: engine.gateway.resubmissions > before, "the resubmission")
        seen.count = engine.gateway.resubmissions - before
        seen.epochs = {row.request_id: row.epoch for row in engine.requests()}
    finally:
        os.kill(workers["worker0-r0"].pid, signal.SIGCONT)


def actors(engine: AsyncLLM) -> dict[str, dict[str, Any]]:
    return {row.name: row for row in engine.actors()}


def replica_rows(engine: AsyncLLM) -> list[dict[str, Any]]:
    return engine.stats().replicas


# ---- serving ----------------------------------------------------------------------------------


async def test_greedy_outputs_equal_transformers_on_both_replicas(shared: Shared) -> None:
    jobs = workload()
    greedy_on = set()
    for job, outcome, replica in zip(
        jobs, shared.reference.outcomes, shared.reference.replicas, strict=True
    ):
        assert len(outcome.token_ids) == MAX_TOKENS and outcome.finish_reason == "length"
        if job.greedy:
            assert_greedy_matches_hf(shared.path, job.prompt, outcome.token_ids)
            greedy_on.add(replica)
    assert greedy_on == {0, 1}


async def test_concurrent_requests_are_spread_evenly_over_both_replicas(shared: Shared) -> None:
    engine = shared.engine
    before = replica_rows(engine)
    progress = [0] * STREAMS
    both_busy: list[list[int]] = []

    async def note_in_flight() -> None:
        both_busy.append([row.in_flight for row in replica_rows(engine)])

    run = await run_workload(engine, progress, note_in_flight, lambda p: min(p) >= 1)
    assert run.outcomes == shared.reference.outcomes
    # Equal requests submitted together alternate: four on each replica, running side by side.
    assert sorted(run.replicas) == [0] * (STREAMS // 2) + [1] * (STREAMS // 2)
    assert all(count >= 1 for count in both_busy[0]), both_busy
    after = replica_rows(engine)
    for old, new in zip(before, after, strict=True):
        assert new.routed_requests - old.routed_requests == STREAMS // 2
        assert new.num_steps > old.num_steps  # each replica's scheduler did the work
    await wait_for(
        lambda: all(row.in_flight == 0 for row in replica_rows(engine)), "both replicas idle"
    )
    assert [row.pending_tokens for row in replica_rows(engine)] == [0, 0]


# ---- a replica's worker killed -----------------------------------------------------------------


async def test_sigkill_of_one_replicas_worker_restarts_it_and_only_its_requests_resume(
    shared: Shared,
) -> None:
    engine = shared.engine
    before = actors(engine)
    seen = Resubmitted()
    run = await run_workload(
        engine, [0] * STREAMS, lambda: kill_replica_1_worker_with_replica_0_paused(engine, seen)
    )
    shared.note_pids()
    assert run.outcomes == shared.reference.outcomes
    after = actors(engine)
    assert after["worker0-r1"].restarts == 1
    assert after["worker0-r1"].pid != before["worker0-r1"].pid
    assert "SIGKILL" in after["worker0-r1"].last_restart_reason
    # Replica 0 was not touched: same processes, and its requests went on in their first epoch.
    for name in ("worker0-r0", "scheduler-r0", "tokenizer-r0", "detokenizer-r0"):
        assert (after[name].pid, after[name].restarts) == (before[name].pid, 0), name
    assert sorted(map(len, seen.on_replica.values())) == [STREAMS // 2] * 2
    assert seen.count == STREAMS // 2
    assert {seen.epochs[r] for r in seen.on_replica[0]} == {0}
    assert {seen.epochs[r] for r in seen.on_replica[1]} == {1}
    assert engine.health().ready


async def test_past_its_restart_intensity_a_replica_gives_up_and_the_other_serves_all(
    shared: Shared,
) -> None:
    engine = shared.engine
    victim = actors(engine)["worker0-r1"].pid
    seen = Resubmitted()
    run = await run_workload(
        engine, [0] * STREAMS, lambda: kill_replica_1_worker_with_replica_0_paused(engine, seen)
    )
    shared.note_pids()
    assert run.outcomes == shared.reference.outcomes
    rows = replica_rows(engine)
    assert rows[0].state == "running" and rows[1].state == "failed"
    assert "restart intensity" in rows[1].reason and "SIGKILL" in rows[1].reason
    assert engine.health() == Health(ready=True, not_ready=[], reason=None)
    assert not any(name.endswith("-r1") for name in actors(engine))
    # Replica 1's requests moved to replica 0 and were resumed there; replica 0's own ran on.
    assert seen.count == STREAMS // 2
    assert {seen.epochs[r] for r in seen.on_replica[0]} == {0}
    assert {seen.epochs[r] for r in seen.on_replica[1]} == {1}
    assert run.replicas == [0] * STREAMS
    # From now on every request goes to replica 0, and still completes as before.
    routed = rows[0].routed_requests
    again = await run_workload(engine, [0] * STREAMS)
    assert again.outcomes == shared.reference.outcomes
    assert again.replicas == [0] * STREAMS
    assert replica_rows(engine)[0].routed_requests == routed + STREAMS
    assert not alive(victim)


async def test_after_shutdown_no_process_or_segment_is_left(shared: Shared) -> None:
    engine = shared.engine
    shared.note_pids()
    await asyncio.wait_for(engine.shutdown(), WAIT_S)
    assert [pid for pid in shared.pids if alive(pid)] == []
    assert children_started_since(shared.children_before) == []
    assert sorted(ipc_files() - shared.ipc_before) == []
