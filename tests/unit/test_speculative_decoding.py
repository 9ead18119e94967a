"""Speculative decoding with n-gram proposals: the proposer, the verification's distribution,
and the scheduler with a real worker step on a tiny checkpoint producing exactly the tokens it
produces without speculation, in fewer steps."""

from __future__ import annotations

import msgspec
import pytest
import torch

from engine.messages.params import SamplingParams, StructuredOutputsParams
from engine.model.runner import ModelRunner
from engine.model.sampling.sampler import Sampler
from engine.model.speculation.verify import residual_distribution, verify_proposals
from engine.model.step import StepExecutor
from engine.model.step_inputs import SeqChunk, SequenceStart
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.scheduler import Scheduler
from engine.scheduler.speculation import (
    MAX_PAUSE_STEPS,
    ProposalLength,
    parse_speculative_config,
    propose_ngram,
)
from tests.checkpoints import tiny_checkpoint
from tests.speculation_runs import run_to_end

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'  # noqa: E501


# ---- proposals -----------------------------------------------------------------------------------


def test_the_longest_suffix_proposes_what_followed_its_first_occurrence() -> None:
    tokens = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 1, 2, 3]
    # [1, 2, 3] occurred at 0 (then 9, 9, 7, 2); [2, 3] alone later at 6 (then 4, 5): longest wins.
    assert propose_ngram(tokens, 2, 3, 4) == [9, 9, 7, 2]
    assert propose_ngram(tokens, 2, 2, 4) == [9, 9, 7, 2]  # the first [2, 3], at 1, not at 6
    assert propose_ngram([7, 2, 3, 5, 2, 3, 8, 2, 3], 2, 2, 1) == [5]  # vLLM's scan: the first
    assert propose_ngram(tokens, 2, 3, 2) == [9, 9]
    assert propose_ngram([5, 6, 7, 8], 1, 3, 4) == []  # nothing repeats
    assert propose_ngram([4, 4, 4], 2, 2, 3) == [4]  # what follows may reach the suffix


def test_the_draft_length_follows_how_the_last_draft_fared() -> None:
    """Whole drafts double the next one up to num_speculative_tokens, a cut one gives what it
    accepted plus one, a rejected one pauses the sequence 2, 4, ... steps, then probes."""
    lengths = ProposalLength(8)
    assert lengths.limit(1, step=1) == 8  # a new sequence: the configured length
    lengths.record(1, proposed=8, accepted=3, step=1)
    assert lengths.limit(1, step=2) == 4
    lengths.record(1, proposed=4, accepted=4, step=2)
    assert lengths.limit(1, step=3) == 8
    lengths.record(1, proposed=2, accepted=2, step=3)  # lookup found only 2: no evidence
    assert lengths.limit(1, step=4) == 8
    lengths.record(1, proposed=8, accepted=0, step=4)  # rejected whole: pause 2 steps
    assert [lengths.limit(1, step) for step in (5, 6)] == [0, 1]
    lengths.record(1, proposed=1, accepted=0, step=6)  # the probe missed: pause 4
    assert [lengths.limit(1, step) for step in (7, 9, 10)] == [0, 0, 1]
    lengths.record(1, proposed=1, accepted=1, step=10)  # a probe held: grow again
    assert [lengths.limit(1, 11), lengths.limit(2, 11)] == [2, 8]  # sequences apart
    for step in range(12, 30):
        lengths.record(3, proposed=1, accepted=0, step=step * 100)
    assert lengths.limit(3, 2900 + MAX_PAUSE_STEPS - 1) == 0
    assert lengths.limit(3, 2900 + MAX_PAUSE_STEPS) == 1  # the pause is bounded
    lengths.forget(1)
    assert lengths.limit(1, 11) == 8


def test_a_bad_speculative_config_is_refused_naming_the_field() -> None:
    assert parse_speculative_config("") is None
    config = parse_speculative_config(NGRAM)
    assert config is not None and config.num_speculative_tokens == 4
    for text, words in (
        ("{nope", "not JSON"),
        ('{"method": "eagle"}', "method must be one of ['ngram', 'draft_model']"),
        ('{"method": "draft_model"}', "a model is named with method draft_model"),
        ('{"method": "ngram", "model": "m"}', "got method 'ngram', model 'm'"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
        ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min <="),
        ('{"lookahead": 3}', "lookahead"),
    ):
        with pytest.raises(ValueError, match=None) as caught:
            parse_speculative_config(text)
        assert words in str(caught.value), (text, str(caught.value))


# ---- verification keeps the target distribution -------------------------------------------------


def test_verification_samples_the_target_distribution_and_accepts_with_its_probability() -> None:
    """Rows of one fixed distribution p, proposal t = token 2, many seeds: the first token out
    is distributed as p (chi-square), t is accepted about p[t] of the time, a rejection draws
    from p without t, and every token equals what the plain sampler draws for that seed."""
    vocab, draws, proposal = 6, 2000, 2
    logits_row = torch.tensor([1.0, 0.2, 0.7, -0.5, 0.0, -1.2])
    p = torch.softmax(logits_row, dim=0)
    params = SamplingParams(temperature=1.0, max_tokens=100)

    def sampler_for(seeds: range) -> Sampler:
        sampler = Sampler(vocab, [])
        for seed in seeds:
            sampler.add(SequenceStart(seed, [0, 1], [], params, seed * 7919 + 13))
        return sampler

    seeds = range(draws)
    chunks = [SeqChunk(seed, [1, proposal], 1, [0], True, 1) for seed in seeds]
    logits = logits_row.repeat(2 * draws, 1)  # two rows per chunk: decode token, proposal
    seq_ids, tokens, _ = verify_proposals(sampler_for(seeds), chunks, logits)
    first: dict[int, int] = {}
    for seq_id, token in zip(seq_ids, tokens, strict=True):
        first.setdefault(seq_id, token)
    plain, _ = sampler_for(seeds).sample(list(seeds), logits_row.repeat(draws, 1))
    assert [first[seed] for seed in seeds] == plain  # the non-speculative tokens themselves

    counts = torch.bincount(torch.tensor(plain), minlength=vocab).double()
    expected = p.double() * draws
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 20.5  # 5 degrees of freedom: p < 0.001 of failing by chance
    accepted = sum(1 for token in plain if token == proposal) / draws
    assert abs(accepted - float(p[proposal])) < 4 * (float(p[proposal]) / draws) ** 0.5
    rejected = torch.tensor([token for token in plain if token != proposal])
    residual = residual_distribution(p.double(), proposal)
    seen = torch.bincount(rejected, minlength=vocab).double() / len(rejected)
    assert float((seen - residual).abs().max()) < 0.03
    assert seen[proposal] == 0.0


# ---- the scheduler and a real step ---------------------------------------------------------------


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(str(tiny_checkpoint("qwen3")), kv_cache_memory=1 << 21, block_size=4)


def generate(
    runner: ModelRunner,
    requests: dict[str, tuple[list[int], SamplingParams]],
    speculative: str,
    resubmit: tuple[str, int] | None = None,
) -> tuple[dict[str, list[int]], Scheduler]:
    """Every request's tokens, run to the end; `resubmit` (request, step): that request comes
    again in a new epoch after that step, with its tokens so far, as after an actor restart."""
    config = SchedulerConfig(
        num_blocks=runner.num_blocks,
        block_size=runner.block_size,
        max_model_len=256,
        speculative_config=speculative,
    )
    scheduler = Scheduler(config)
    executor = StepExecutor(runner, rank=0)
    seeds = {request_id: seed + 5 for seed, request_id in enumerate(requests)}
    return run_to_end(scheduler, executor, requests, seeds, resubmit), scheduler


def test_speculative_output_is_the_plain_output_token_for_token_in_fewer_steps(
    runner: ModelRunner,
) -> None:
    """A batch mixing a repetitive greedy prompt, a sampled one with a seed (resubmitted
    mid-stream, as after a restart), one with logprobs, one held to a regex and one whose
    prompt never repeats: the same tokens as without speculation, and the speculating
    sequences accept proposals."""
    phrase = [11, 42, 97, 5, 300, 17, 64, 23]
    requests = {
        "repeat": (phrase * 4, SamplingParams(temperature=0.0, max_tokens=32)),
        "sampled": (phrase * 3, SamplingParams(temperature=0.7, max_tokens=20)),
        "logprobs": (phrase * 2, SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)),
        "plain": (list(range(100, 140)), SamplingParams(temperature=0.0, max_tokens=12)),
        "regex": (
            phrase * 2,
            SamplingParams(
                temperature=0.0,
                max_tokens=16,
                structured_outputs=(
                    StructuredOutputsParams(regex=r"(cat|dog|bird)( (cat|dog|bird)){30}")
                ),
            ),
        ),
    }
    plain, off = generate(runner, requests, "")
    spec, on = generate(runner, requests, NGRAM, resubmit=("sampled", 6))
    assert spec == plain
    assert off.speculator is None and on.speculator is not None
    tally = on.speculator.tally
    assert tally.num_drafts > 0 and tally.num_accepted_tokens > 0
    assert on.num_steps < off.num_steps
    assert sum(tally.accepted_per_position) == tally.num_accepted_tokens


def test_spec_decode_counts_sum_over_replicas_and_reach_metrics_with_vllms_names() -> None:
    from engine.http.metrics import ServerMetrics
    from engine.inflight.replicas import merge_reports
    from engine.messages.admin import EngineStats
    from engine.messages.reports import SchedulerReport
    from engine.messages.scheduling import SchedulerStats

    def report(drafts: int, per_position: list[int]) -> SchedulerReport:
        stats = SchedulerStats(
            spec_decode_num_drafts=drafts,
            spec_decode_num_draft_tokens=4 * drafts,
            spec_decode_num_accepted_tokens=sum(per_position),
            spec_decode_num_accepted_tokens_per_pos=per_position,
        )
        return SchedulerReport(stats, [])

    merged = merge_reports([report(3, [3, 1]), report(2, [2, 1, 1])]).stats
    assert merged.spec_decode_num_drafts == 5 and merged.spec_decode_num_draft_tokens == 20
    assert merged.spec_decode_num_accepted_tokens_per_pos == [5, 2, 1]
    root = dict(
        in_flight=0,
        resubmitted_requests=0,
        stalled_stream_aborts=0,
        restarts={},
        kv_cache_blocks=1,
        replicas=[],
    )
    stats = EngineStats(**msgspec.structs.asdict(merged), **root)  # type: ignore[arg-type]
    text = ServerMetrics(lambda: [("m", lambda: stats, {})], "m").render().decode()
    assert 'engine:spec_decode_num_drafts_total{model_name="m"} 5.0' in text
    assert 'engine:spec_decode_num_accepted_tokens_total{model_name="m"} 8.0' in text
    assert (
        'engine:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0'
        in text
    )
