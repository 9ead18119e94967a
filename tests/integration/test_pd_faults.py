"""P/D disaggregation under faults, with real processes: one launch with a prefill replica and a
decode replica (docs/architecture.md, 'P/D disaggregation'), each with its kv_transfer actor.

One engine (module scope) serves every test. The undisturbed workload (greedy and seeded
streams) runs first; every disturbed run must reproduce it token for token: no token lost or
repeated. Pulls are slowed (KV_PULL_DELAY_ENV, read by the kv_transfer actors; like the workers'
fault injection, never set by the engine itself) so that a kill lands while KV is on
its way. After each fault, no KV block stays held or set aside on either side; the last tests
take the decode replica away for good (the prefill replica then serves colocated) and check
that shutdown leaves no process or segment.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import pytest_asyncio

from engine import AsyncLLM, SamplingParams
from engine.library.llm import build_settings
from engine.messages.admin import ReplicaRow
from engine.testing import combined
from engine.testing.fault_injection import KV_PULL_DELAY_ENV, environment
from tests.checkpoints import tiny_checkpoint
from tests.environment import environment_set
from tests.holds import held, hold_env
from tests.integration.test_fault_tolerance import (
    Job,
    Outcome,
    Shared,
    alive,
    children_of,
    children_started_since,
    no_leftover_segments,  # noqa: F401  (autouse here: the last test checks after shutdown)
    run_job,
    wait_for,
)
from tests.ipc_files import ipc_files

pytestmark = pytest.mark.asyncio(loop_scope="module")

STREAMS = 6
MAX_TOKENS = 48
PROMPT_LEN = 40  # two full blocks of 16 and a partial one
# The prompts are held (tests/holds.py): 20 ms a token on any machine, so a stream disturbed
# after 10 tokens still has most of its tokens to make.
PULL_DELAY_S = 1.5
WAIT_S = 180.0
PREFILL, DECODE = 0, 1  # replica indices (prefill replicas come first)


def workload() -> list[Job]:
    jobs = []
    for i in range(STREAMS):
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
        if i % 2:
            params.temperature, params.top_p, params.seed = 0.9, 0.95, 700 + i
        jobs.append(Job(held([5 + 13 * i + k for k in range(PROMPT_LEN - 1)]), params))
    return jobs


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared() -> AsyncIterator[Shared]:
    path = str(tiny_checkpoint(arch="llama"))
    settings = build_settings(
        **{
            "model.path": path,
            "model.max_model_len": 512,
            "cache.kv_cache_memory": 2 * 2**20,
            "kv_transfer.prefill_replicas": 1,
            "kv_transfer.decode_replicas": 1,
            # A hold whose puller died ends by this timeout: short, so that the tests need not
            # wait long to see every block free again; long enough for a delayed pull.
            "kv_transfer.hold_timeout": 6.0,
            "runtime.restart_intensity": 3,
            "runtime.restart_period": 3600.0,
            # A worker the tests stop (SIGSTOP) to hold it stays stopped until they kill it.
            "runtime.heartbeat_timeout": 120.0,
            "runtime.stopped_timeout": 120.0,
        }
    )
    ipc_before = ipc_files()
    children_before = set(children_of(os.getpid()))
    # the actors inherit it
    delay = environment(KV_PULL_DELAY_ENV, str(PULL_DELAY_S))
    with environment_set(combined(delay, hold_env())):
        engine = AsyncLLM(settings)
        try:
            await asyncio.wait_for(engine.start(), WAIT_S)
            reference = await run_workload(engine)
            state = Shared(engine, reference, ipc_before, children_before, set())
            state.note_pids()
            yield state
        finally:
            await asyncio.wait_for(engine.shutdown(), WAIT_S)


async def run_workload(
    engine: AsyncLLM,
    disturb: Callable[[], Awaitable[None]] | None = None,
    when: Callable[[list[int]], bool] = lambda progress: True,
) -> list[Outcome]:
    progress = [0] * STREAMS
    runs = asyncio.ensure_future(
        asyncio.gather(*(run_job(engine, job, progress, i) for i, job in enumerate(workload())))
    )
    try:
        if disturb is not None:
            await wait_for(lambda: when(progress) or runs.done(), "the streams under way")
            assert not runs.done(), "the workload finished before it could be disturbed"
            await disturb()
        return list(await asyncio.wait_for(runs, WAIT_S))
    finally:
        runs.cancel()


def pid_of(engine: AsyncLLM, name: str) -> int | None:
    """The actor's pid; None while it restarts, or when its replica is gone."""
    found = [row.pid for row in engine.actors() if row.name == name]
    return found[0] if found else None


def kill_actor(engine: AsyncLLM, name: str) -> None:
    pid = pid_of(engine, name)
    assert pid is not None, f"{name} is not running"
    os.kill(pid, signal.SIGKILL)


def rows(engine: AsyncLLM) -> list[ReplicaRow]:
    return engine.stats().replicas


async def no_block_held_or_set_aside(engine: AsyncLLM) -> None:
    """Every hold ended, every pull settled, and every block is free (cached or clean) again."""

    def settled() -> bool:
        replicas = rows(engine)
        return all(
            row.kv_holds == 0 and row.kv_pulls_in_flight == 0 and row.kv_usage == 0.0
            for row in replicas
            if row.state == "running"
        )

    await wait_for(settled, "every KV block free on both sides", timeout=60.0)


def first_tokens_out(progress: list[int]) -> bool:
    """Every stream has its first token (from the prefill replica): its KV is on the way."""
    return min(progress) >= 1


# ---- faults ----------------------------------------------------------------------------------


async def test_the_undisturbed_run_moved_kv_for_every_request(shared: Shared) -> None:
    def counted() -> bool:  # the replicas' reports may arrive after the streams have ended
        replicas = rows(shared.engine)
        return replicas[PREFILL].kv_handoffs == STREAMS and replicas[DECODE].kv_pulls == STREAMS

    await wait_for(counted, "every request handed off and pulled", timeout=30.0)
    replicas = rows(shared.engine)
    assert replicas[PREFILL].role == "prefill" and replicas[DECODE].role == "decode"
    assert replicas[DECODE].kv_fallbacks == 0
    assert all(
        o.finish_reason == "length" and len(o.token_ids) == MAX_TOKENS for o in shared.reference
    )
    await no_block_held_or_set_aside(shared.engine)


async def test_decode_side_kv_transfer_killed_mid_transfer(shared: Shared) -> None:
    engine = shared.engine
    fallbacks = rows(engine)[DECODE].kv_fallbacks

    async def kill() -> None:
        kill_actor(engine, "kv_transfer0-r1")

    outcomes = await run_workload(engine, kill, first_tokens_out)
    assert outcomes == shared.reference
    # The pulls in flight died with it: their requests computed their prompts themselves.
    assert rows(engine)[DECODE].kv_fallbacks > fallbacks
    await no_block_held_or_set_aside(engine)
    shared.note_pids()


async def test_prefill_side_kv_transfer_killed_while_its_blocks_are_pulled(shared: Shared) -> None:
    engine = shared.engine

    async def kill() -> None:
        kill_actor(engine, "kv_transfer0-r0")

    outcomes = await run_workload(engine, kill, first_tokens_out)
    assert outcomes == shared.reference
    await no_block_held_or_set_aside(engine)
    shared.note_pids()


async def test_prefill_worker_killed_while_requests_are_prefilled(shared: Shared) -> None:
    engine = shared.engine
    worker = pid_of(engine, "worker0-r0")
    assert worker is not None
    # Stopped, it cannot finish a prefill before it is killed: every request is then still
    # being prefilled, and is prefilled again by the restarted worker.
    os.kill(worker, signal.SIGSTOP)

    async def kill() -> None:
        await wait_for(lambda: len(engine.requests()) == STREAMS, "the requests in flight")
        await asyncio.sleep(0.5)  # at the prefill replica's scheduler, waiting for the worker
        os.kill(worker, signal.SIGKILL)

    try:
        outcomes = await run_workload(engine, kill)
    finally:
        if alive(worker):
            os.kill(worker, signal.SIGKILL)
    assert outcomes == shared.reference
    await no_block_held_or_set_aside(engine)
    shared.note_pids()


async def test_decode_worker_killed_mid_stream(shared: Shared) -> None:
    engine = shared.engine

    async def kill() -> None:
        kill_actor(engine, "worker0-r1")

    outcomes = await run_workload(engine, kill, lambda progress: min(progress) >= 10)
    assert outcomes == shared.reference
    await no_block_held_or_set_aside(engine)
    shared.note_pids()


async def test_with_no_decode_replica_left_the_prefill_replica_serves_colocated(
    shared: Shared,
) -> None:
    engine = shared.engine

    def decode_failed() -> bool:
        return rows(engine)[DECODE].state == "failed"

    async def kill_until_it_gives_up() -> None:
        # Its restart intensity (3) lets it give up at the 4th kill of this module at most.
        for _ in range(4):
            if decode_failed():
                return
            await wait_for(
                lambda: decode_failed() or pid_of(engine, "worker0-r1") is not None,
                "the decode worker",
            )
            pid = pid_of(engine, "worker0-r1")
            if pid is None:
                break
            os.kill(pid, signal.SIGKILL)
            await wait_for(
                lambda pid=pid: decode_failed() or pid_of(engine, "worker0-r1") not in (None, pid),
                "a restart or the replica's end",
            )
        await wait_for(decode_failed, "the decode replica to give up")

    shared.note_pids()
    outcomes = await run_workload(engine, kill_until_it_gives_up, lambda p: min(p) >= 5)
    assert outcomes == shared.reference
    assert decode_failed()
    # And new requests are served too, all on the prefill replica.
    assert await run_workload(engine) == shared.reference


async def test_after_shutdown_no_process_or_segment_is_left(shared: Shared) -> None:
    engine = shared.engine
    shared.note_pids()
    await asyncio.wait_for(engine.shutdown(), WAIT_S)
    assert [pid for pid in shared.pids if alive(pid)] == []
    assert children_started_since(shared.children_before) == []
    assert sorted(ipc_files() - shared.ipc_before) == []
