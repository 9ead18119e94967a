"""Scheduler behaviour, driven step by step by a reference worker.

The worker is the simplest faithful stand-in for what ranks do with a plan: it writes each
chunk's token ids into a paged "KV cache" (a token id per slot, addressed through the chunk's
block table), and when a chunk asks for a sample it reads the whole sequence back through the
block table and picks the next token as a fixed function of (seed, tokens). A wrong block table,
a stale or overwritten shared block, a missed position or a resumed sequence that lost its
history all show up as a read that differs from the sequence, or as different tokens.
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Callable

import pytest

from engine.messages.failures import RequestFailed
from engine.messages.params import SamplingParams
from engine.messages.scheduling import (
    SampleResume,
    StopSamples,
    SubmitRequest,
    TokenBatch,
)
from engine.messages.steps import STEP_PLANS, SampledLogprobs, StepPlan, StepResult
from engine.model.step_inputs import KnownSequences
from engine.scheduler import Scheduler, SchedulerConfig
from engine.scheduler.requests import derive_seed

EOS = 0
NextToken = Callable[[int, list[int]], int]


def default_next_token(seed: int, tokens: list[int]) -> int:
    """Never EOS; depends on the whole history so a lost or altered token changes what follows."""
    return (seed + sum(tokens) * 31 + len(tokens) * 7) % 97 + 1


class ReferenceWorker:
    def __init__(self, block_size: int, next_token: NextToken = default_next_token) -> None:
        self.block_size = block_size
        self.next_token = next_token
        self.cache: dict[int, list[int | None]] = defaultdict(lambda: [None] * block_size)
        self.history: dict[int, list[int]] = {}
        self.seeds: dict[int, int] = {}
        self.wants_logprobs: dict[int, bool] = {}
        self.known = KnownSequences()

    def run(self, plan: StepPlan) -> StepResult:
        for seq_id in plan.finished_seq_ids:
            self.history.pop(seq_id)
        # What the ranks keep between plans is the real worker code: plans carry deltas.
        starts, chunks = self.known.apply(plan)
        for new in starts:
            tokens = [*new.prompt_token_ids, *new.output_token_ids]
            if new.seq_id in self.history:  # re-announced after preemption: same history
                assert self.history[new.seq_id] == tokens
            self.history[new.seq_id] = tokens
            self.seeds[new.seq_id] = new.seed
            self.wants_logprobs[new.seq_id] = new.params.logprobs is not None
        seq_ids, token_ids = [], []
        for chunk in chunks:
            history = self.history[chunk.seq_id]
            end = chunk.start_pos + len(chunk.token_ids)
            assert chunk.token_ids == history[chunk.start_pos : end]
            assert len(chunk.block_table) == -(-end // self.block_size)
            for offset, token in enumerate(chunk.token_ids):
                position = chunk.start_pos + offset
                block = chunk.block_table[position // self.block_size]
                self.cache[block][position % self.block_size] = token
            assert chunk.sample == (end == len(history))
            if chunk.sample:
                cached = [
                    self.cache[chunk.block_table[p // self.block_size]][p % self.block_size]
                    for p in range(end)
                ]
                assert cached == history, f"seq {chunk.seq_id} read wrong KV"
                token = self.next_token(self.seeds[chunk.seq_id], history)
                history.append(token)
                seq_ids.append(chunk.seq_id)
                token_ids.append(token)
        logprobs = None
        if any(self.wants_logprobs[seq_id] for seq_id in seq_ids):
            logprobs = [SampledLogprobs(-float(t), [t], [-float(t)]) for t in token_ids]
        return StepResult(plan.step_id, seq_ids, token_ids, logprobs)


class Outputs:
    """What the detokenizer would receive, per (request, epoch, sample)."""

    def __init__(self) -> None:
        self.tokens: dict[tuple[str, int], list[int]] = defaultdict(list)
        self.finish: dict[tuple[str, int], str] = {}
        self.epochs: dict[tuple[str, int], set[int]] = defaultdict(set)

    def add(self, batch: TokenBatch | None) -> None:
        for item in batch.items if batch is not None else []:
            key = (item.request_id, item.index)
            assert key not in self.finish, f"{key} got tokens after it finished"
            self.tokens[key].extend(item.new_token_ids)
            self.epochs[key].add(item.epoch)
            if item.finish_reason is not None:
                self.finish[key] = item.finish_reason


def make(num_blocks: int = 64, **overrides: object) -> tuple[Scheduler, ReferenceWorker]:
    fields: dict[str, object] = dict(
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=64,
        eos_token_ids=[EOS],
    )
    fields.update(overrides)
    config = SchedulerConfig(**fields)  # type: ignore[arg-type]
    return Scheduler(config), ReferenceWorker(config.block_size)


def submit(request_id: str, prompt: list[int], epoch: int = 0, seed: int = 1, **params: object):
    return SubmitRequest(request_id, epoch, prompt, SamplingParams(**params), seed)  # type: ignore[arg-type]


def step(scheduler: Scheduler, worker: ReferenceWorker, outputs: Outputs) -> StepPlan | None:
    plan = scheduler.schedule()
    if plan is not None:
        config = scheduler.config
        result = worker.run(plan)
        assert sum(c.num_tokens for c in plan.chunks) <= config.max_num_batched_tokens
        assert len(plan.chunks) <= config.max_num_seqs
        assert len(STEP_PLANS.encode(plan)) <= config.max_plan_bytes
        if plan.chunks:
            outputs.add(scheduler.update(result))
    scheduler.kv.pool.check_invariants()
    return plan


def run_to_end(scheduler: Scheduler, worker: ReferenceWorker, max_steps: int = 500) -> Outputs:
    outputs = Outputs()
    for _ in range(max_steps):
        if step(scheduler, worker, outputs) is None and not scheduler.has_unfinished_requests:
            return outputs
    raise AssertionError(f"not done after {max_steps} steps: {scheduler.stats()}")


def expected(
    prompt: list[int],
    seed: int,
    max_tokens: int,
    max_model_len: int = 64,
    next_token: NextToken = default_next_token,
    index: int = 0,
) -> list[int]:
    tokens = list(prompt)
    sample_seed = derive_seed(seed, index)
    while len(tokens) - len(prompt) < max_tokens and len(tokens) < max_model_len:
        tokens.append(next_token(sample_seed, tokens))
        if tokens[-1] == EOS:
            break
    return tokens[len(prompt) :]


def assert_no_state_left(scheduler: Scheduler, worker: ReferenceWorker) -> None:
    assert scheduler.schedule() is None
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_requests) == (0, 0, 0)
    assert scheduler.kv.num_free_blocks == scheduler.config.num_blocks
    assert stats.kv_usage == 0.0
    assert scheduler.request_statuses() == []
    assert not worker.history, "workers were told to drop every sequence"
    assert not worker.known.requests and not worker.known.block_tables, "... and every request"


# ---- basics --------------------------------------------------------------------------------------


def test_a_request_generates_max_tokens_then_finishes_with_length_leaving_no_state() -> None:
    scheduler, worker = make()
    prompt = [5, 6, 7, 8, 9]
    assert scheduler.add(submit("r", prompt, max_tokens=6)) is None
    outputs = run_to_end(scheduler, worker)
    assert outputs.tokens["r", 0] == expected(prompt, 1, 6)
    assert len(outputs.tokens["r", 0]) == 6
    assert outputs.finish["r", 0] == "length"
    assert_no_state_left(scheduler, worker)


def test_generation_stops_at_max_model_len_with_length() -> None:
    scheduler, worker = make(max_model_len=20)
    prompt = list(range(1, 16))
    scheduler.add(submit("r", prompt, max_tokens=None))
    outputs = run_to_end(scheduler, worker)
    assert len(prompt) + len(outputs.tokens["r", 0]) == 20
    assert outputs.finish["r", 0] == "length"


def test_a_request_without_max_tokens_stops_at_the_default_bound_or_the_context() -> None:
    """limits.default_max_tokens bounds a sample that sets no max_tokens; max_model_len still
    ends one that reaches it first, and an explicit max_tokens is the request's own."""
    scheduler, worker = make(max_model_len=40, default_max_tokens=7)
    scheduler.add(submit("unset", [1, 2, 3], max_tokens=None))
    scheduler.add(submit("long-prompt", list(range(1, 36)), max_tokens=None))
    scheduler.add(submit("own", [1, 2, 3], max_tokens=12))
    outputs = run_to_end(scheduler, worker)
    assert outputs.tokens["unset", 0] == expected([1, 2, 3], 1, 7)
    assert len(outputs.tokens["long-prompt", 0]) == 40 - 35
    assert len(outputs.tokens["own", 0]) == 12
    assert {outputs.finish[r, 0] for r in ("unset", "long-prompt", "own")} == {"length"}
    assert_no_state_left(scheduler, worker)


def test_eos_stops_unless_ignored_and_only_after_min_tokens() -> None:
    def eos_at_third(seed: int, tokens: list[int]) -> int:
        return EOS if len(tokens) % 3 == 0 else 50

    scheduler, _ = make()
    worker = ReferenceWorker(4, eos_at_third)
    prompt = [1, 2, 3, 4]  # outputs: 50, 50, EOS, 50, 50, EOS, ...
    scheduler.add(submit("plain", prompt, max_tokens=10))
    scheduler.add(submit("ignore", prompt, max_tokens=10, ignore_eos=True))
    scheduler.add(submit("min", prompt, max_tokens=10, min_tokens=4))
    scheduler.add(submit("stop-id", prompt, max_tokens=10, stop_token_ids=[50]))
    outputs = run_to_end(scheduler, worker)
    assert outputs.tokens["plain", 0] == [50, 50, EOS]
    assert outputs.finish["plain", 0] == "stop"
    assert len(outputs.tokens["ignore", 0]) == 10
    assert outputs.finish["ignore", 0] == "length"
    assert outputs.tokens["min", 0] == [50, 50, EOS, 50, 50, EOS]  # the first EOS: too early
    assert outputs.finish["min", 0] == "stop"
    assert outputs.tokens["stop-id", 0] == [50]
    assert outputs.finish["stop-id", 0] == "stop"


@pytest.mark.parametrize(
    ("prompt_len", "fragment"),
    [
        (65, "the prompt has 65 tokens, but max_model_len is 64"),
        (64, "the prompt has 64 tokens, but max_model_len is 64"),
    ],
)
def test_a_prompt_without_room_to_generate_is_rejected_naming_both_numbers(
    prompt_len: int, fragment: str
) -> None:
    scheduler, _ = make()
    rejected = scheduler.add(submit("long", [1] * prompt_len, epoch=3))
    assert isinstance(rejected, RequestFailed)
    assert (rejected.request_id, rejected.epoch, rejected.status) == ("long", 3, 400)
    assert fragment in rejected.message
    assert not scheduler.has_unfinished_requests
    assert scheduler.schedule() is None


def test_prompt_logprobs_that_could_not_travel_in_one_message_are_rejected() -> None:
    # Prompt logprobs go to the client in one message with the first token: a client must not
    # be able to make one that no ring could carry (it would fail an actor, not the request).
    scheduler, _ = make(max_plan_bytes=64 * 2**10)
    rejected = scheduler.add(submit("many", list(range(40)), prompt_logprobs=20))
    assert isinstance(rejected, RequestFailed) and rejected.status == 400
    assert "prompt_logprobs=20 on a prompt of 40 tokens" in rejected.message
    assert scheduler.add(submit("few", list(range(40)), prompt_logprobs=5)) is None


def test_logprobs_reach_only_the_samples_that_asked() -> None:
    scheduler, worker = make()
    scheduler.add(submit("with", [1, 2, 3], max_tokens=2, logprobs=1))
    scheduler.add(submit("without", [1, 2, 3], max_tokens=2))
    plan = scheduler.schedule()
    assert plan is not None
    batch = scheduler.update(worker.run(plan))
    by_id = {item.request_id: item for item in batch.items}
    [token] = by_id["with"].new_token_ids
    assert by_id["with"].logprobs == [SampledLogprobs(-float(token), [token], [-float(token)])]
    assert by_id["without"].logprobs is None


# ---- batching ------------------------------------------------------------------------------------


def test_a_long_prompt_is_prefilled_in_chunks_within_the_token_budget() -> None:
    scheduler, worker = make(max_num_batched_tokens=8)
    prompt = list(range(1, 31))
    scheduler.add(submit("r", prompt, max_tokens=3))
    outputs = Outputs()
    chunks = []
    while (plan := step(scheduler, worker, outputs)) is not None:
        chunks.extend((c.start_pos, c.num_tokens, c.sample) for c in plan.chunks)
    assert chunks[:4] == [(0, 8, False), (8, 8, False), (16, 8, False), (24, 6, True)]
    assert chunks[4:] == [(30, 1, True), (31, 1, True)]
    assert outputs.tokens["r", 0] == expected(prompt, 1, 3)


def test_decodes_run_before_new_prefills_which_take_the_rest_of_the_budget() -> None:
    scheduler, worker = make(max_num_batched_tokens=10)
    outputs = Outputs()
    scheduler.add(submit("a", [1, 2, 3], max_tokens=20))
    scheduler.add(submit("b", [4, 5, 6], max_tokens=20))
    step(scheduler, worker, outputs)  # both prefilled, both decode from now on
    scheduler.add(submit("long", list(range(1, 40)), max_tokens=2))
    plan = step(scheduler, worker, outputs)
    assert plan is not None
    sizes = [(c.seq_id, c.num_tokens) for c in plan.chunks]
    assert sizes == [(0, 1), (1, 1), (2, 8)]
    plan = step(scheduler, worker, outputs)  # the long prefill continues, decodes still first
    assert plan is not None
    assert [(c.seq_id, c.num_tokens, c.start_pos) for c in plan.chunks] == [
        (0, 1, 4),
        (1, 1, 4),
        (2, 8, 8),
    ]


def test_no_more_than_max_num_seqs_run_at_once() -> None:
    scheduler, worker = make(max_num_seqs=2)
    for i in range(5):
        scheduler.add(submit(f"r{i}", [i + 1, 2, 3], max_tokens=3))
    outputs = Outputs()
    while step(scheduler, worker, outputs) is not None:
        assert scheduler.stats().num_running <= 2
    assert all(len(outputs.tokens[f"r{i}", 0]) == 3 for i in range(5))


def test_a_token_budget_smaller_than_max_num_seqs_still_serves_every_request() -> None:
    # A step samples at most `budget` sequences, so decodes never outnumber the budget: every
    # running sequence gets its token each step, and newcomers take what the decodes leave.
    scheduler, worker = make(max_num_seqs=8, max_num_batched_tokens=3)
    for i in range(5):
        scheduler.add(submit(f"r{i}", [i + 1, 2, 3, 4], max_tokens=6))
    outputs = Outputs()
    while step(scheduler, worker, outputs) is not None:
        decoding = [s for s in scheduler.planner.running if s.num_uncomputed_tokens == 1]
        assert len(decoding) <= 3
    for i in range(5):
        assert outputs.tokens[f"r{i}", 0] == expected([i + 1, 2, 3, 4], 1, 6)


def test_with_a_tiny_pool_preemption_lets_every_request_finish_with_all_its_tokens() -> None:
    # 10 blocks of 4 = 40 token slots for six requests that need up to 21 slots each.
    scheduler, worker = make(num_blocks=10, max_model_len=40)
    prompts = {f"r{i}": [i + 1] * (5 + i) for i in range(6)}
    for request_id, prompt in prompts.items():
        scheduler.add(submit(request_id, prompt, max_tokens=16, seed=len(prompt)))
    outputs = run_to_end(scheduler, worker)
    assert scheduler.stats().num_preemptions > 0
    for request_id, prompt in prompts.items():
        assert outputs.tokens[request_id, 0] == expected(prompt, len(prompt), 16)
        assert outputs.finish[request_id, 0] == "length"
    assert_no_state_left(scheduler, worker)


@pytest.mark.parametrize("caching", [True, False])
def test_preempted_sequences_are_reannounced_with_their_generated_tokens(caching: bool) -> None:
    scheduler, worker = make(num_blocks=6, max_model_len=24, enable_prefix_caching=caching)
    scheduler.add(submit("a", [1] * 9, max_tokens=12))
    scheduler.add(submit("b", [2] * 9, max_tokens=12))
    outputs = Outputs()
    reannounced = []
    while (plan := step(scheduler, worker, outputs)) is not None:
        reannounced += [new for new in plan.new_seqs if new.output_token_ids]
    assert reannounced, "the pool is too small for both: one must have been preempted"
    assert all(new.seed == derive_seed(1, 0) for new in reannounced)
    assert outputs.tokens["a", 0] == expected([1] * 9, 1, 12)
    assert outputs.tokens["b", 0] == expected([2] * 9, 1, 12)


# ---- prefix sharing ------------------------------------------------------------------------------


def test_a_full_prefix_hit_still_computes_at_least_one_token() -> None:
    scheduler, worker = make()
    prompt = list(range(1, 9))  # exactly two blocks
    scheduler.add(submit("first", prompt, max_tokens=2))
    run_to_end(scheduler, worker)
    scheduler.add(submit("again", prompt, max_tokens=2))
    plan = scheduler.schedule()
    assert plan is not None
    [chunk] = plan.chunks
    # The prompt's last 4 tokens, named (the ranks have the prompt), not sent again.
    assert (chunk.start_pos, chunk.prompt_tokens, chunk.token_ids, chunk.sample) == (4, 4, [], True)
    assert scheduler.stats().prefix_cache_hit_rate == pytest.approx(4 / 16)
    scheduler.update(worker.run(plan))
    run_to_end(scheduler, worker)
    assert_no_state_left(scheduler, worker)


def test_a_request_sharing_a_cached_prefix_skips_its_computed_blocks() -> None:
    scheduler, worker = make()
    system = list(range(1, 13))  # three full blocks
    scheduler.add(submit("first", [*system, 50, 51], max_tokens=1))
    run_to_end(scheduler, worker)
    scheduler.add(submit("second", [*system, 60], max_tokens=3))
    plan = scheduler.schedule()
    assert plan is not None
    assert [(c.start_pos, c.num_tokens) for c in plan.chunks] == [(12, 1)]
    outputs = Outputs()
    outputs.add(scheduler.update(worker.run(plan)))
    while step(scheduler, worker, outputs) is not None:
        pass
    assert outputs.tokens["second", 0] == expected([*system, 60], 1, 3)
    assert scheduler.stats().prefix_cache_hit_rate > 0


@pytest.mark.parametrize("caching", [True, False])
def test_samples_of_one_request_share_the_prompt_blocks(caching: bool) -> None:
    scheduler, worker = make(enable_prefix_caching=caching)
    prompt = list(range(1, 11))  # blocks [1..4] [5..8] + partial [9, 10]
    scheduler.add(submit("r", prompt, seed=7, n=3, max_tokens=4))
    outputs = Outputs()
    first = step(scheduler, worker, outputs)
    assert first is not None
    assert [new.seq_id for new in first.new_seqs] == [0]  # siblings wait for the prompt
    second = step(scheduler, worker, outputs)
    assert second is not None
    # Each of these is its sequence's first chunk: it carries the whole block table.
    leader_table = first.chunks[0].new_block_ids
    followers = [c for c in second.chunks if c.seq_id != 0]
    assert [(c.start_pos, c.prompt_tokens) for c in followers] == [(8, 2), (8, 2)]  # 9, 10
    for chunk in followers:
        assert chunk.new_block_ids[:2] == leader_table[:2]  # shared, not recomputed
        assert chunk.new_block_ids[2] != leader_table[2]  # the partial block is their own
    assert [new.seed for new in second.new_seqs] == [derive_seed(7, 1), derive_seed(7, 2)]
    while step(scheduler, worker, outputs) is not None:
        pass
    for index in range(3):
        assert outputs.tokens["r", index] == expected(prompt, 7, 4, index=index)
    assert len({tuple(outputs.tokens["r", i]) for i in range(3)}) == 3  # seeds differ
    assert_no_state_left(scheduler, worker)


# ---- abort, epochs, recovery ---------------------------------------------------------------------


def test_abort_frees_blocks_at_once_and_a_late_result_is_ignored() -> None:
    scheduler, worker = make(enable_prefix_caching=False)
    for i in range(3):
        scheduler.add(submit(f"r{i}", [i + 1] * 9, max_tokens=10))
    outputs = Outputs()
    step(scheduler, worker, outputs)
    plan = scheduler.schedule()  # in flight while the abort arrives
    assert plan is not None
    scheduler.abort(["r0", "r1", "r2", "unknown"])
    assert scheduler.kv.num_free_blocks == scheduler.config.num_blocks
    assert scheduler.update(worker.run(plan)).items == []
    cleanup = scheduler.schedule()
    assert cleanup is not None
    assert cleanup.chunks == []
    assert sorted(cleanup.finished_seq_ids) == [0, 1, 2]
    worker.run(cleanup)
    assert_no_state_left(scheduler, worker)


def test_stopping_one_sample_keeps_its_siblings_running() -> None:
    scheduler, worker = make()
    scheduler.add(submit("r", [1, 2, 3], n=2, max_tokens=5))
    outputs = Outputs()
    step(scheduler, worker, outputs)
    step(scheduler, worker, outputs)
    scheduler.stop_samples(StopSamples("r", 0, [0]))
    scheduler.stop_samples(StopSamples("r", 99, [1]))  # another epoch: not this request
    outputs.finish["r", 0] = "stop"  # the detokenizer's decision
    while step(scheduler, worker, outputs) is not None:
        pass
    assert len(outputs.tokens["r", 0]) < 5
    assert len(outputs.tokens["r", 1]) == 5
    assert_no_state_left(scheduler, worker)


def test_a_newer_epoch_replaces_the_request_and_continues_exactly() -> None:
    prompt = [3, 1, 4, 1, 5, 9, 2]
    full = expected(prompt, 11, 12)
    scheduler, worker = make()
    scheduler.add(submit("r", prompt, epoch=0, seed=11, max_tokens=12))
    outputs = Outputs()
    for _ in range(4):
        step(scheduler, worker, outputs)
    delivered = list(outputs.tokens["r", 0])
    assert delivered == full[: len(delivered)]
    in_flight = scheduler.schedule()  # its result will arrive after the resubmission
    assert in_flight is not None
    resubmit = submit("r", prompt, epoch=1, seed=11, max_tokens=12)
    resubmit.resume = [SampleResume(0, delivered)]
    assert scheduler.add(resubmit) is None
    assert scheduler.add(submit("r", prompt, epoch=0, seed=11)) is None  # stale: ignored
    assert scheduler.update(worker.run(in_flight)).items == []
    plan = scheduler.schedule()
    assert plan is not None
    assert plan.finished_seq_ids == [0]
    [new] = plan.new_seqs
    assert (new.seq_id, new.output_token_ids, new.seed) == (1, delivered, derive_seed(11, 0))
    outputs.add(scheduler.update(worker.run(plan)))
    while step(scheduler, worker, outputs) is not None:
        pass
    assert outputs.tokens["r", 0] == full
    assert outputs.epochs["r", 0] == {0, 1}
    assert_no_state_left(scheduler, worker)


def test_resuming_only_unfinished_samples_and_finishing_complete_ones_at_once() -> None:
    scheduler, worker = make()
    resubmit = submit("r", [1, 2, 3], epoch=2, n=3, max_tokens=4)
    resubmit.resume = [SampleResume(1, [7, 7]), SampleResume(2, [7, 7, 7, 7])]
    assert scheduler.add(resubmit) is None
    done = scheduler.take_outputs()
    assert done is not None
    [finished] = done.items
    assert (finished.index, finished.new_token_ids, finished.finish_reason) == (2, [], "length")
    assert scheduler.take_outputs() is None
    outputs = run_to_end(scheduler, worker)
    assert set(outputs.tokens) == {("r", 1)}
    assert len(outputs.tokens["r", 1]) == 2  # 2 delivered + 2 new = max_tokens
    assert_no_state_left(scheduler, worker)


def test_bad_resume_indices_are_rejected() -> None:
    scheduler, _ = make()
    resubmit = submit("r", [1, 2], n=2)
    resubmit.resume = [SampleResume(2, [])]
    rejected = scheduler.add(resubmit)
    assert isinstance(rejected, RequestFailed)
    assert "[0, 2)" in rejected.message


def test_after_workers_restart_everything_is_recomputed_and_continues_exactly() -> None:
    scheduler, worker = make()
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7, 8, 9], "b": [1, 2, 3, 4, 5, 6, 7, 8, 10]}
    for request_id, prompt in prompts.items():
        scheduler.add(submit(request_id, prompt, max_tokens=8))
    outputs = Outputs()
    for _ in range(3):
        step(scheduler, worker, outputs)
    lost = scheduler.schedule()
    assert lost is not None
    scheduler.on_workers_restarted()
    worker = ReferenceWorker(4)  # fresh ranks: empty cache, no sequences
    plan = scheduler.schedule()
    assert plan is not None
    assert {new.seq_id for new in plan.new_seqs} == {0, 1}
    assert all(chunk.start_pos == 0 for chunk in plan.chunks)  # no stale prefix reused
    late = StepResult(lost.step_id, [c.seq_id for c in lost.chunks], [1] * len(lost.chunks))
    assert scheduler.update(late).items == []  # the lost step's result, arriving late
    outputs.add(scheduler.update(worker.run(plan)))
    while step(scheduler, worker, outputs) is not None:
        pass
    for request_id, prompt in prompts.items():
        assert outputs.tokens[request_id, 0] == expected(prompt, 1, 8)
    assert_no_state_left(scheduler, worker)


def test_the_admin_listing_shows_each_unfinished_request() -> None:
    scheduler, worker = make(max_num_seqs=1)
    scheduler.add(submit("a", [1, 2, 3], max_tokens=5))
    scheduler.add(submit("b", [4, 5], max_tokens=5))
    step(scheduler, worker, Outputs())
    listing = {status.request_id: status for status in scheduler.request_statuses()}
    assert listing["a"].states == ["running"]
    assert listing["a"].num_output_tokens == [1]
    assert listing["b"].states == ["waiting"]
    assert listing["b"].num_prompt_tokens == 2
    stats = scheduler.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_requests) == (1, 1, 2)
    assert 0 < stats.kv_usage < 1


def test_config_that_cannot_hold_one_full_sequence_is_refused() -> None:
    config = SchedulerConfig(num_blocks=3, block_size=4, max_model_len=16)
    with pytest.raises(ValueError, match=r"holds 12 tokens .* fewer than max_model_len 16"):
        Scheduler(config)


@pytest.mark.parametrize("trial", range(12))
def test_random_workloads_produce_exactly_the_reference_tokens(trial: int) -> None:
    rng = random.Random(trial)
    scheduler, worker = make(
        num_blocks=rng.choice([12, 16, 40]),
        block_size=4,
        max_num_seqs=rng.choice([2, 4, 8]),
        max_num_batched_tokens=rng.choice([8, 16, 64]),
        max_model_len=40,
        enable_prefix_caching=rng.random() < 0.7,
    )
    system = [rng.randint(1, 9) for _ in range(8)]
    wanted: dict[tuple[str, int], list[int]] = {}
    aborted: set[str] = set()
    outputs = Outputs()
    for number in range(10):
        shared = system[: rng.choice([0, 4, 8])]
        prompt = shared + [rng.randint(1, 9) for _ in range(rng.randint(1, 12))]
        max_tokens = rng.randint(1, 15)
        n = rng.choice([1, 1, 2, 3])
        request_id = f"r{number}"
        scheduler.add(submit(request_id, prompt, seed=number, n=n, max_tokens=max_tokens))
        for index in range(n):
            wanted[request_id, index] = expected(prompt, number, max_tokens, 40, index=index)
        for _ in range(rng.randint(0, 3)):
            step(scheduler, worker, outputs)
        if rng.random() < 0.15:
            victim = f"r{rng.randint(0, number)}"
            scheduler.abort([victim])
            aborted.add(victim)
    while step(scheduler, worker, outputs) is not None:
        pass
    for (request_id, index), tokens in wanted.items():
        got = outputs.tokens.get((request_id, index), [])
        if request_id in aborted:
            assert got == tokens[: len(got)]
        else:
            assert got == tokens, (request_id, index)
            assert (request_id, index) in outputs.finish
    assert_no_state_left(scheduler, worker)


def test_the_first_token_reports_cache_hits_queue_and_prefill_time_once() -> None:
    now = [100.0]
    config = SchedulerConfig(
        num_blocks=64,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=32,
        max_model_len=64,
        eos_token_ids=[EOS],
    )
    scheduler, worker = Scheduler(config, clock=lambda: now[0]), ReferenceWorker(4)
    system = list(range(1, 13))  # three full blocks
    scheduler.add(submit("first", [*system, 50], max_tokens=1))
    run_to_end(scheduler, worker)
    scheduler.add(submit("second", [*system, 60], max_tokens=3, n=2))
    now[0] = 101.5  # it waited 1.5 s before its first step
    plan = scheduler.schedule()
    assert plan is not None
    now[0] = 102.0  # and prefilled for 0.5 s
    first = scheduler.update(worker.run(plan)).items
    reports = [item.first for item in first if item.first is not None]
    assert len(reports) == 1  # one per request, on its first token, whatever n
    assert reports[0].num_cached_tokens == 12
    assert (reports[0].queue_s, reports[0].prefill_s) == (1.5, 0.5)
    rest = []
    while (plan := scheduler.schedule()) is not None:
        result = worker.run(plan)
        if plan.chunks:
            rest += scheduler.update(result).items
    assert len(rest) == 4 and all(item.first is None for item in rest)  # 2 x 2 more tokens
    scheduler.add(submit("third", [*system, 70], max_tokens=2))
    plan = scheduler.schedule()
    assert plan is not None
    items = scheduler.update(worker.run(plan)).items
    assert [item.first.num_cached_tokens for item in items if item.first] == [12]
