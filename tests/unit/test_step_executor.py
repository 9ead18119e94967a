"""The worker's step, without rings or processes: a sequence that breaks the step fails alone
(its neighbours still get transformers' tokens), and a step in which everything fails is the
worker's fault, not the requests'."""

from __future__ import annotations

import threading

import pytest

from engine.messages.params import SamplingParams, StructuredOutputsParams
from engine.messages.steps import (
    NewRequest,
    NewSeq,
    PlannedChunk,
    StepPlan,
    StepResult,
    WorkerFailed,
)
from engine.model.runner import ModelRunner
from engine.model.step import StepExecutor
from engine.structured import grammars as grammars_module
from engine.testing.fault_injection import FaultInjection, InjectedFault
from tests.checkpoints import assert_same_greedy, hf_greedy, tiny_checkpoint

POISON = 99
GREEDY = SamplingParams(temperature=0.0)


def prefill_plan(
    step_id: int, prompts: dict[int, list[int]], block_size: int, params: SamplingParams = GREEDY
) -> StepPlan:
    """Each sequence id with its own request and blocks, prefilled whole and sampled."""
    new_requests = [NewRequest(seq_id, prompt, params) for seq_id, prompt in prompts.items()]
    new_seqs = [NewSeq(seq_id, seq_id, [], seed=0) for seq_id in prompts]
    chunks, next_block = [], 0
    for seq_id, prompt in prompts.items():
        blocks = -(-len(prompt) // block_size)
        chunks.append(
            PlannedChunk(seq_id, prompt, 0, list(range(next_block, next_block + blocks)), True)
        )
        next_block += blocks
    return StepPlan(step_id, new_requests, new_seqs, chunks, [], [])


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(str(tiny_checkpoint("qwen3")), kv_cache_memory=1 << 20, block_size=4)


def test_a_sequence_that_breaks_the_step_fails_alone(runner: ModelRunner) -> None:
    executor = StepExecutor(runner, rank=0, faults=FaultInjection(f"raise:{POISON}"))
    good, bad = [5, 6, 7, 8, 9], [5, POISON, 7]
    messages = executor.run(prefill_plan(1, {10: good, 11: bad}, runner.block_size))
    failed = [m for m in messages if isinstance(m, WorkerFailed)]
    [result] = [m for m in messages if isinstance(m, StepResult)]
    assert [(f.seq_ids, "InjectedFault" in f.error) for f in failed] == [([11], True)]
    assert result.seq_ids == [10]
    assert_same_greedy(result.token_ids, hf_greedy(tiny_checkpoint("qwen3"), good, 1))


def test_a_step_where_every_sequence_fails_is_the_workers_fault(runner: ModelRunner) -> None:
    executor = StepExecutor(runner, rank=0, faults=FaultInjection(f"raise:{POISON}"))
    plan = prefill_plan(1, {1: [POISON, 5], 2: [6, POISON]}, runner.block_size)
    with pytest.raises(InjectedFault):
        executor.run(plan)


def test_constraints_the_grammar_library_stops_on_fail_with_400_and_the_worker_goes_on(
    runner: ModelRunner,
) -> None:
    """Such a step failed for every sequence in it, which counted as the worker's fault."""
    executor = StepExecutor(runner, rank=0)
    choices = StructuredOutputsParams(choice=[f"c{i}" for i in range(2500)])
    params = SamplingParams(temperature=0.0, structured_outputs=choices)
    prompts = {1: [5, 6, 7], 2: [6, 7, 8]}
    [first] = executor.run(prefill_plan(1, prompts, runner.block_size, params))
    assert isinstance(first, StepResult) and first.seq_ids == [1, 2]
    decode = [  # the row limit is met when the first sampled token is fed to the grammar
        PlannedChunk(seq_id, [token], len(prompts[seq_id]), [], True)
        for seq_id, token in zip(first.seq_ids, first.token_ids, strict=True)
    ]
    messages = executor.run(StepPlan(2, [], [], decode, [], []))
    assert [(m.seq_ids, m.status) for m in messages if isinstance(m, WorkerFailed)] == [
        ([1], 400),
        ([2], 400),
    ]
    assert all("max_items_in_row 2,000" in m.error for m in messages if isinstance(m, WorkerFailed))


def test_a_grammar_still_compiling_when_due_is_a_503_never_a_500(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait for it ran out with a TimeoutError, which failed the request with 500."""
    executor = StepExecutor(runner, rank=0)
    assert executor.grammars is not None
    release = threading.Event()
    compile_for_real = executor.grammars._compile

    def held_compile(spec: StructuredOutputsParams) -> object:  # compiling until released
        release.wait(30)
        return compile_for_real(spec)

    monkeypatch.setattr(executor.grammars, "_compile", held_compile)
    monkeypatch.setattr(grammars_module, "COMPILE_TIMEOUT_S", 0.05)
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]{3}"))
    try:
        messages = executor.run(prefill_plan(1, {1: [5, 6, 7]}, runner.block_size, params))
    finally:
        release.set()
    [failed] = [m for m in messages if isinstance(m, WorkerFailed)]
    assert failed.status == 503 and "try again" in failed.error
