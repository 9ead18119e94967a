"""Any actor can die and every in-flight request still completes (docs/architecture.md,
'Nothing in flight is lost'; issue 6).

One engine serves every test here (module scope, one event loop): each test disturbs it under a
load of 8 concurrent streams, greedy and seeded, and compares every stream with the undisturbed
run, token for token and character for character. The last test shuts it down and checks that
nothing is left: no process, no segment, every KV block back in the pool.

Poison requests use the worker's fault injection (a test facility, see engine/actors/worker.py):
a prompt holding token POISON_RAISE makes the step raise, one holding POISON_EXIT ends the worker
as a native crash would, one holding SLOW makes each of its steps outlast the heartbeat timeout.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from engine import AsyncLLM, EngineError, SamplingParams
from engine.library.embeddings import embed
from engine.library.llm import build_settings
from engine.messages.params import PoolingParams
from engine.request.outputs import EmbeddingRequestOutput
from engine.runtime.stopped import STOPPED_FROM_OUTSIDE
from tests.checkpoints import tiny_checkpoint
from tests.environment import environment_set
from tests.holds import HOLD_TEXT, hold_env
from tests.ipc_files import ipc_files

pytestmark = pytest.mark.asyncio(loop_scope="module")

POISON_RAISE = 501
POISON_EXIT = 502
SLOW = 503  # a prompt holding it makes each of its steps take SLOW_STEP_S
SLOW_STEP_S = 5.0  # longer than the heartbeat timeout below
STREAMS = 8
BLOCK_SIZE = 16  # the default cache.block_size: each stream has a full block when disturbed
# The workload's prompts are held (tests/holds.py): 20 ms a token on any machine, so every
# stream still has 2 s of tokens to make when a test disturbs it after 20.
MAX_TOKENS = 120
WAIT_S = 180.0  # any wait here; a restart takes seconds on a busy machine
EMBEDDINGS = [  # a mean over a long prompt, the last token's hidden state of a short one
    ([(7 * i) % 400 + 3 for i in range(450)], PoolingParams(pooling_type="MEAN")),
    ([9, 4, 33, 120, 5], PoolingParams(pooling_type="LAST", normalize=False)),
]


@dataclass(frozen=True)
class Job:
    prompt: str | list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Outcome:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    error: EngineError | None = None


def workload(count: int = STREAMS, max_tokens: int = MAX_TOKENS) -> list[Job]:
    """Greedy and seeded streams; half of them with a stop string that never matches, so the
    detokenizer holds text back (and must be re-primed exactly) all along."""
    jobs = []
    for i in range(count):
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        if i % 2:
            params.temperature, params.top_p, params.seed = 0.9, 0.95, 1000 + i
        if i % 4 < 2:
            params.stop = ["<never seen>"]
        jobs.append(Job(f"prompt number {i} says" + HOLD_TEXT, params))
    return jobs


async def run_job(engine: AsyncLLM, job: Job, progress: list[int], slot: int) -> Outcome:
    prompt: list[int] = []
    tokens: list[int] = []
    text, finish = "", None
    try:
        async for delta in engine.stream(job.prompt, job.params):
            prompt = delta.prompt_token_ids or prompt
            for output in delta.outputs:
                tokens += output.token_ids
                text += output.text
                finish = output.finish_reason or finish
            progress[slot] = len(tokens)
    except EngineError as error:
        return Outcome(prompt, tokens, text, finish, error)
    return Outcome(prompt, tokens, text, finish)


async def run_all(engine: AsyncLLM, jobs: list[Job], progress: list[int]) -> list[Outcome]:
    runs = (run_job(engine, job, progress, slot) for slot, job in enumerate(jobs))
    return list(await asyncio.wait_for(asyncio.gather(*runs), WAIT_S))


async def wait_for(condition, what: str, timeout: float = WAIT_S) -> None:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        await asyncio.sleep(0.01)


def actor(engine: AsyncLLM, name: str) -> dict:  # type: ignore[type-arg]
    return next(row for row in engine.actors() if row.name == name)


def alive(pid: int) -> bool:
    """Running or a zombie nobody reaped: either way, left behind."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def children_of(parent: int) -> dict[int, str]:
    """Child processes of `parent` (pid: command line), but multiprocessing's resource tracker,
    which serves the test process for as long as it lives."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == parent and "multiprocessing.resource_tracker" not in cmdline:
            children[int(stat.parent.name)] = cmdline
    return children


def children_started_since(before: set[int]) -> list[str]:
    """This process's children that were not there at `before` (the pids then): a server that
    another test module shares for the whole session is not this engine's leftover."""
    return [f"{pid}: {cmd}" for pid, cmd in children_of(os.getpid()).items() if pid not in before]


@pytest.fixture(autouse=True)
def no_leftover_segments() -> Iterator[None]:
    """Replaces the suite's per-test check here: the shared engine gets fresh ring segments
    whenever an actor restarts. The last test checks that none are left after shutdown."""
    yield


@dataclass
class Shared:
    engine: AsyncLLM
    reference: list[Outcome]
    ipc_before: set[Path]
    children_before: set[int]
    pids: set[int]

    def note_pids(self) -> None:
        self.pids.update(row.pid for row in self.engine.actors() if row.pid is not None)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared() -> AsyncIterator[Shared]:
    settings = build_settings(
        **{
            "model.path": str(tiny_checkpoint(arch="qwen3")),
            "model.max_model_len": 512,
            "cache.kv_cache_memory": 4 * 2**20,
            "runtime.heartbeat_interval": 0.5,
            "runtime.heartbeat_timeout": 4.0,
            "runtime.restart_intensity": 100,
            "runtime.quarantine_after": 2,
        }
    )
    ipc_before = ipc_files()
    children_before = set(children_of(os.getpid()))
    spec = f"raise:{POISON_RAISE},exit:{POISON_EXIT},sleep{SLOW_STEP_S:g}:{SLOW}"
    with environment_set(hold_env(spec)):
        engine = AsyncLLM(settings)
        watch: asyncio.Task[None] | None = None
        try:
            await engine.start()
            reference = await run_all(engine, workload(), [0] * STREAMS)
            state = Shared(engine, reference, ipc_before, children_before, set())
            watch = asyncio.ensure_future(note_pids_all_along(state))
            yield state
        finally:
            if watch is not None:
                watch.cancel()
            await engine.shutdown()


async def note_pids_all_along(state: Shared) -> None:
    """Every actor process the engine ever had, so that the last test can look for orphans."""
    while True:
        state.note_pids()
        await asyncio.sleep(0.02)


async def disturb_under_load(  # type: ignore[no-untyped-def]
    shared: Shared, disturb, embedded: list[EmbeddingRequestOutput] | None = None
) -> list[Outcome]:
    """Run the workload, call `disturb()` once every stream has tokens, then submit one more
    request (it reaches whatever is down, or restarting); every outcome, the late one last.
    `embedded`: the EMBEDDINGS requests are also submitted, unanswered, as `disturb()` runs;
    their outputs go there."""
    engine = shared.engine
    jobs = workload()
    progress = [0] * (STREAMS + 1)
    streams = asyncio.ensure_future(run_all(engine, jobs, progress))
    embeddings = None
    try:
        await wait_for(lambda: min(progress[:STREAMS]) >= 20, "every stream under way")
        assert max(progress[:STREAMS]) < MAX_TOKENS // 2, "disturbed too late to test anything"
        if embedded is not None:
            embeddings = asyncio.gather(*(embed(engine, *job) for job in EMBEDDINGS))
            await asyncio.sleep(0)  # each registers and submits its request, then awaits
        disturb()
        late = await asyncio.wait_for(run_job(engine, jobs[0], progress, STREAMS), WAIT_S)
        outcomes = await streams
        if embeddings is not None and embedded is not None:
            embedded += await asyncio.wait_for(embeddings, WAIT_S)
    finally:
        streams.cancel()
        if embeddings is not None:
            embeddings.cancel()
    return [*outcomes, late]


async def test_the_undisturbed_workload_runs_clean_of_poison(shared: Shared) -> None:
    for outcome in shared.reference:
        assert outcome.error is None and len(outcome.token_ids) == MAX_TOKENS
        assert not {POISON_RAISE, POISON_EXIT, SLOW} & set(outcome.prompt_token_ids)
    # The ids the gateway learnt of each text prompt (from the tokenizer actor, on their own
    # ring) are transformers' own; every SIGKILL test below expects them again in its outputs,
    # the late request's among them, tokenized by a restarted tokenizer or while the
    # detokenizer was down.
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint(arch="qwen3"))
    for job, outcome in zip(workload(), shared.reference, strict=True):
        assert outcome.prompt_token_ids == tokenizer(job.prompt)["input_ids"]


@pytest.mark.parametrize("victim", ["tokenizer", "scheduler", "worker0", "detokenizer"])
async def test_sigkill_under_load_every_stream_completes_as_if_undisturbed(
    shared: Shared, victim: str
) -> None:
    engine = shared.engine
    # Embeddings in flight when a worker dies recompute (a mean from the prompt's first token).
    embedded: list[EmbeddingRequestOutput] | None = [] if victim == "worker0" else None
    undisturbed = [await embed(engine, *job) for job in EMBEDDINGS] if embedded is not None else []
    before = actor(engine, victim)
    resubmitted = engine.gateway.resubmissions
    # A restarted scheduler counts from zero; a worker's restart leaves the count going on.
    hits_before = 0 if victim == "scheduler" else engine.stats().prefix_cache_hit_tokens
    outcomes = await disturb_under_load(
        shared, lambda: os.kill(before.pid, signal.SIGKILL), embedded
    )
    assert outcomes == [*shared.reference, shared.reference[0]]
    if victim in ("scheduler", "worker0"):  # the KV outlived the victim: no full block again
        wanted = hits_before + STREAMS * BLOCK_SIZE
        await wait_for(
            lambda: engine.stats().prefix_cache_hit_tokens >= wanted,
            "every resubmitted stream found its full blocks in the prefix cache",
            timeout=5,
        )
    for ours, reference in zip(embedded or [], undisturbed, strict=True):
        assert ours.outputs.embedding == pytest.approx(reference.outputs.embedding, abs=1e-5)
    if embedded is not None:  # the streams and the embeddings went again
        assert engine.gateway.resubmissions >= resubmitted + STREAMS + len(EMBEDDINGS)
    after = actor(engine, victim)
    assert after.restarts > before.restarts and after.pid != before.pid
    assert "SIGKILL" in after.last_restart_reason
    assert engine.gateway.resubmissions > resubmitted
    if victim == "tokenizer":  # it had passed every stream on: only the late request goes again
        assert engine.gateway.resubmissions == resubmitted + 1
    assert engine.gateway.quarantined == 0 and engine.health().ready


async def test_a_hung_actor_is_found_by_missed_heartbeats_killed_and_restarted(
    shared: Shared,
) -> None:
    engine = shared.engine
    before = actor(engine, "scheduler")
    outcomes = await disturb_under_load(shared, lambda: os.kill(before.pid, signal.SIGSTOP))
    assert outcomes == [*shared.reference, shared.reference[0]]
    after = actor(engine, "scheduler")
    assert after.pid != before.pid and "process state is T" in after.last_restart_reason
    # Stopped by a signal, not hung by a request: its death makes no request a suspect.
    assert STOPPED_FROM_OUTSIDE in after.last_restart_reason
    assert not alive(before.pid)
    assert engine.gateway.quarantined == 0


async def test_a_step_that_raises_fails_only_its_request_with_500(shared: Shared) -> None:
    engine = shared.engine
    restarts = actor(engine, "worker0").restarts
    jobs = workload(4, max_tokens=60)
    poison = Job([11, 12, POISON_RAISE, 13], SamplingParams(max_tokens=60, temperature=0.0))
    progress = [0] * 5
    reference = await run_all(engine, jobs, progress)
    outcomes = await run_all(engine, [*jobs, poison], progress)
    assert outcomes[:4] == reference
    error = outcomes[4].error
    assert error is not None and error.status == 500
    assert "InjectedFault" in error.message and "the model failed" in error.message
    assert actor(engine, "worker0").restarts == restarts  # the worker went on
    assert await engine.complete(jobs[0].prompt, jobs[0].params) is not None


async def test_steps_longer_than_the_heartbeat_timeout_are_not_taken_for_a_hang(
    shared: Shared,
) -> None:
    engine = shared.engine
    before = actor(engine, "worker0")
    timeout = engine.settings.runtime.heartbeat_timeout
    assert timeout < SLOW_STEP_S  # each step of this request holds the worker that long
    slow = Job([11, 12, SLOW, 13], SamplingParams(max_tokens=2, temperature=0.0))
    [outcome] = await run_all(engine, [slow], [0])
    assert outcome.error is None and len(outcome.token_ids) == 2
    after = actor(engine, "worker0")
    assert (after.pid, after.restarts) == (before.pid, before.restarts)
    assert engine.gateway.quarantined == 0


async def test_a_request_that_keeps_crashing_the_worker_is_quarantined_alone(
    shared: Shared,
) -> None:
    engine = shared.engine
    restarts = actor(engine, "worker0").restarts
    jobs = workload(3, max_tokens=60)
    poison = Job([11, 12, POISON_EXIT, 13], SamplingParams(max_tokens=60, temperature=0.0))
    reference = await run_all(engine, jobs, [0] * 3)
    # Submitted together: the first crash happens with all four in flight, so all four are
    # suspects; retried one at a time, the innocent ones pass and the poison crashes it alone.
    outcomes = await run_all(engine, [*jobs, poison], [0] * 4)
    assert outcomes[:3] == reference
    error = outcomes[3].error
    assert error is not None and error.status == 500 and "quarantined" in error.message
    assert "2 actor crashes" in error.message and "status 70" in error.message
    assert actor(engine, "worker0").restarts == restarts + 2
    assert engine.gateway.quarantined == 1 and not engine.gateway.on_probation
    assert all(row.strikes == 0 for row in engine.requests())


async def test_after_everything_nothing_is_left_and_the_kv_pool_is_full(shared: Shared) -> None:
    engine = shared.engine
    await wait_for(
        lambda: (
            engine.stats().num_requests == 0
            and engine.stats().num_free_blocks == engine.stats().kv_cache_blocks
        ),
        "the scheduler reports every KV block free",
        timeout=30,
    )
    assert len(engine.gateway) == 0
    shared.note_pids()
    await engine.shutdown()
    assert len(shared.pids) >= len(engine.actors())
    assert [pid for pid in shared.pids if alive(pid)] == []
    # Not even one the watch missed, nor a zombie.
    assert children_started_since(shared.children_before) == []
    assert sorted(ipc_files() - shared.ipc_before) == []
