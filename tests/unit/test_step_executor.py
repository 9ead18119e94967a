"""The worker's step, without rings or processes: a sequence that breaks the step fails alone
(its neighbours still get transformers' tokens), and a step in which everything fails is the
worker's fault, not the requests'."""

from __future__ import annotations

import pytest

from engine.messages.params import SamplingParams
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
from engine.testing.fault_injection import FaultInjection, InjectedFault
from tests.checkpoints import assert_same_greedy, hf_greedy, tiny_checkpoint

POISON = 99
GREEDY = SamplingParams(temperature=0.0)


def prefill_plan(step_id: int, prompts: dict[int, list[int]], block_size: int) -> StepPlan:
    """Each sequence id with its own request and blocks, prefilled whole and sampled."""
    new_requests = [NewRequest(seq_id, prompt, GREEDY) for seq_id, prompt in prompts.items()]
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
