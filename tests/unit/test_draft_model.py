"""Speculative decoding with a draft model: the scheduler and real worker steps on tiny
checkpoints give exactly the non-speculative greedy tokens (the same checkpoint as draft
accepting every proposal, a different random one none) and, by default, the non-speculative
sampled tokens, batched or alone, resumed or not (in deterministic mode too); the first
speculative token of sampled requests is distributed as transformers' softmax of the target
under both acceptance rules, vLLM's rejection sampler accepting as often as rejection sampling
against the draft's (transformers') distribution does, the default rule at most that."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from engine.actors.configs import WorkerConfig
from engine.actors.worker import _drafter
from engine.launch.draft import draft_model_path
from engine.launch.plan import plan_engine
from engine.library.llm import build_settings
from engine.messages.params import SamplingParams, StructuredOutputsParams
from engine.messages.steps import NewRequest, NewSeq, PlannedChunk, StepPlan, StepResult
from engine.model.config import load_model_config
from engine.model.runner import ModelRunner
from engine.model.speculation.drafter import Drafter
from engine.model.step import StepExecutor
from engine.scheduler.config import SchedulerConfig
from engine.scheduler.scheduler import Scheduler
from engine.settings import Settings
from tests.checkpoints import hf_logits, tiny_checkpoint
from tests.speculation_runs import run_to_end

K = 3  # num_speculative_tokens
PHRASE = [11, 42, 97, 5, 300, 17, 64, 23]


def draft_config(path: Path, acceptance_method: str = "target_draw") -> str:
    return json.dumps(
        {"model": str(path), "num_speculative_tokens": K, "acceptance_method": acceptance_method}
    )


@pytest.fixture(scope="module")
def target() -> Path:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def other() -> Path:
    """Another random model with the target's shapes and tokenizer."""
    return tiny_checkpoint("qwen3", seed=1)


@pytest.fixture(scope="module")
def runner(target: Path) -> ModelRunner:
    return ModelRunner(str(target), kv_cache_memory=1 << 21, block_size=4)


def generate(
    executor: StepExecutor,
    requests: dict[str, tuple[list[int], SamplingParams]],
    speculative: str,
    resubmit: tuple[str, int] | None = None,
) -> tuple[dict[str, list[int]], Scheduler]:
    """Every request's tokens, run to the end; `resubmit` (request, step): that request comes
    again in a new epoch after that step, with its tokens so far, as after an actor restart."""
    runner = executor.runner
    config = SchedulerConfig(
        num_blocks=runner.num_blocks,
        block_size=runner.block_size,
        max_model_len=256,
        speculative_config=speculative,
    )
    scheduler = Scheduler(config)
    executor.reset_sequences()
    seeds = {request_id: 100 + sum(map(ord, request_id)) for request_id in requests}
    return run_to_end(scheduler, executor, requests, seeds, resubmit, max_steps=300), scheduler


GREEDY = {
    "repeat": (PHRASE * 3, SamplingParams(temperature=0.0, max_tokens=20)),
    "logprobs": (PHRASE * 2, SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)),
    "long": (list(range(100, 160)), SamplingParams(temperature=0.0, max_tokens=14)),
    "regex": (
        PHRASE,
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            structured_outputs=(
                StructuredOutputsParams(regex=r"(cat|dog|bird)( (cat|dog|bird)){30}")
            ),
        ),
    ),
}


def test_greedy_output_is_the_plain_output_with_the_same_or_another_draft(
    runner: ModelRunner, target: Path, other: Path
) -> None:
    """The same checkpoint as draft: every proposal accepted, fewer steps. Another random
    model as draft: the same tokens still (with logprobs, a grammar, a long prompt drafted
    after its prefill, and a request resubmitted mid-stream as after a restart)."""
    plain, off = generate(StepExecutor(runner, 0), GREEDY, "")
    unconstrained = {name: request for name, request in GREEDY.items() if name != "regex"}
    same = StepExecutor(runner, 0, drafter=Drafter(str(target), runner))
    spec, on = generate(same, unconstrained, draft_config(target))
    assert spec == {name: plain[name] for name in unconstrained}
    assert on.speculator is not None
    tally = on.speculator.tally
    assert tally.num_draft_tokens > 0
    assert tally.num_accepted_tokens == tally.num_draft_tokens  # the draft is the target
    assert on.num_steps < off.num_steps / 2  # (the grammar's request ran there too)

    another = StepExecutor(runner, 0, drafter=Drafter(str(other), runner))
    spec, on = generate(another, GREEDY, draft_config(other), resubmit=("repeat", 5))
    assert spec == plain
    assert on.speculator is not None and on.speculator.tally.num_drafts > 0


SAMPLED = {
    "a": (PHRASE * 2, SamplingParams(temperature=0.8, max_tokens=16)),
    "b": (list(range(200, 230)), SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12)),
    "c": (PHRASE * 3, SamplingParams(temperature=1.0, top_k=20, max_tokens=12, logprobs=1)),
}


def test_sampled_output_is_the_plain_output_with_another_draft_resumed_or_not(
    runner: ModelRunner, other: Path
) -> None:
    """The default rule: sampled, seeded requests with another random model as draft get the
    tokens of no speculation, batched and one resubmitted mid-stream (as after a restart), or
    alone: which positions were drafted changes nothing. vLLM's rejection sampler on the same
    requests draws other tokens (the same distribution, not the same draws)."""
    plain, _ = generate(StepExecutor(runner, 0), SAMPLED, "")
    executor = StepExecutor(runner, 0, drafter=Drafter(str(other), runner))
    batched, on = generate(executor, SAMPLED, draft_config(other), resubmit=("a", 4))
    alone, _ = generate(executor, {"a": SAMPLED["a"]}, draft_config(other))
    assert batched == plain
    assert alone["a"] == plain["a"]
    assert on.speculator is not None and on.speculator.tally.num_drafts > 0
    rejection = Drafter(str(other), runner, rejection_sampling=True)
    executor = StepExecutor(runner, 0, drafter=rejection)
    drawn, _ = generate(executor, SAMPLED, draft_config(other, "rejection_sampler"))
    assert drawn != plain


def test_deterministic_mode_gives_the_plain_sampled_tokens_in_any_batch(
    target: Path, other: Path
) -> None:
    """Batch-invariant kernels, sampled requests with seeds: with another model as draft, alone
    or batched with others, resubmitted mid-stream or not, and with n-gram proposals, the tokens
    without speculation."""
    runner = ModelRunner(
        str(target), kv_cache_memory=1 << 20, block_size=4, kernel_backend="batch_invariant"
    )
    drafter = Drafter(str(other), runner, kernel_backend="batch_invariant")
    sampled = {
        "a": (PHRASE * 2, SamplingParams(temperature=0.8, max_tokens=16)),
        "b": (list(range(200, 230)), SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12)),
        "c": (PHRASE * 3, SamplingParams(temperature=0.0, max_tokens=10)),
    }
    plain, _ = generate(StepExecutor(runner, 0), sampled, "")
    executor = StepExecutor(runner, 0, drafter=drafter)
    batched, on = generate(executor, sampled, draft_config(other), resubmit=("a", 4))
    alone, _ = generate(executor, {"a": sampled["a"]}, draft_config(other))
    assert batched == plain
    assert alone["a"] == plain["a"]
    assert on.speculator is not None and on.speculator.tally.num_drafts > 0
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": K})
    looked_up, on = generate(StepExecutor(runner, 0), sampled, ngram, resubmit=("b", 3))
    assert looked_up == plain
    assert on.speculator is not None and on.speculator.tally.num_drafts > 0


def test_the_first_speculative_token_keeps_the_target_distribution_under_both_rules(
    runner: ModelRunner, target: Path, other: Path
) -> None:
    """Many seeded sequences at the same context (prompt + one token), each drafting with
    another random model: under both rules the first token out is distributed as transformers'
    softmax p of the target (chi-square). vLLM's rejection sampler accepts the first proposal
    about sum(min(p, q)) of the time, q the draft's softmax from transformers; the default rule
    on the same draws (accepted where the target's own draw agrees) at most that, and far more
    often than independent draws would agree (sum(p * q))."""
    context = [*PHRASE, 7]
    p = torch.softmax(hf_logits(target, context)[-1].double(), dim=0)
    q = torch.softmax(hf_logits(other, context)[-1].double(), dim=0)
    draws = 1000
    rejection = Drafter(str(other), runner, rejection_sampling=True)
    firsts, accepted = first_tokens(StepExecutor(runner, 0, drafter=rejection), draws)
    assert chi_square_fits(torch.tensor(firsts), p, draws)
    expected = float(torch.minimum(p, q).sum())
    sigma = math.sqrt(expected * (1 - expected) / draws)
    assert float((p * q).sum()) < expected - 0.05  # the two rules tell apart here
    assert abs(accepted / draws - expected) < 4 * sigma

    coupled = StepExecutor(runner, 0, drafter=Drafter(str(other), runner))
    own_firsts, own_accepted = first_tokens(coupled, draws)
    assert chi_square_fits(torch.tensor(own_firsts), p, draws)
    assert float((p * q).sum()) + 4 * sigma < own_accepted / draws < expected + 4 * sigma


def first_tokens(executor: StepExecutor, draws: int) -> tuple[list[int], int]:
    """Each of `draws` seeded sequences' first token after PHRASE + [7] with one proposal
    (later ones cannot change the first token), and how many had it accepted."""
    prompt, last, per_round = PHRASE, 7, 500
    params = SamplingParams(temperature=1.0, max_tokens=50)
    prefill = StepPlan(
        0,
        [NewRequest(0, prompt, params)],
        [NewSeq(0, 0, [last], 1)],
        [PlannedChunk(0, [], 0, [0, 1], False, len(prompt))],
        [],
        [],
    )
    executor.run(prefill)  # the prompt's KV (blocks 0 and 1), in the target and the draft
    firsts: list[int] = []
    accepted = 0
    previous: list[int] = [0]
    for round_ in range(draws // per_round):
        ids = [1 + round_ * per_round + i for i in range(per_round)]
        plan = StepPlan(
            1 + round_,
            [],
            [NewSeq(seq_id, 0, [last], seq_id * 7919 + 13) for seq_id in ids],
            [
                PlannedChunk(s, [last], len(prompt), [0, 1, 2 + i], True, 0, 0, 1)
                for i, s in enumerate(ids)
            ],
            previous,
            [],
        )
        (result,) = executor.run(plan)
        assert isinstance(result, StepResult)
        counts = Counter(result.seq_ids)
        accepted += sum(1 for seq_id in ids if counts[seq_id] > 1)
        for seq_id in ids:
            firsts.append(result.token_ids[result.seq_ids.index(seq_id)])
        previous = ids
    return firsts, accepted


def chi_square_fits(samples: torch.Tensor, p: torch.Tensor, draws: int) -> bool:
    """Pearson's test at p < 0.001, tokens expected fewer than 5 times pooled into one bin."""
    counts = torch.bincount(samples, minlength=len(p)).double()
    expected = p * draws
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    wanted = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    statistic = float(((observed - wanted) ** 2 / wanted).sum())
    freedom = len(observed) - 1
    # Wilson-Hilferty: the chi-square quantile from the normal one (z = 3.09 for 0.001).
    critical = freedom * (1 - 2 / (9 * freedom) + 3.09 * math.sqrt(2 / (9 * freedom))) ** 3
    return statistic < critical


def test_a_draft_with_another_vocabulary_or_tensor_parallelism_is_refused_in_one_line(
    runner: ModelRunner, target: Path
) -> None:
    smaller = tiny_checkpoint("qwen3", vocab_size=384)
    with pytest.raises(ValueError, match="vocabulary of 384 tokens, the target's has 512"):
        Drafter(str(smaller), runner)
    config = load_model_config(target)

    def settings(speculative: str, tp: int = 1) -> Settings:
        base = Settings()
        return msgspec.structs.replace(
            base,
            scheduler=msgspec.structs.replace(base.scheduler, speculative_config=speculative),
            parallel=msgspec.structs.replace(base.parallel, tensor_parallel_size=tp),
        )

    assert draft_model_path(settings(""), str(target), config) == ""
    assert draft_model_path(settings(draft_config(target)), str(target), config) == str(target)
    for speculative, tp, words in (
        (draft_config(smaller), 1, "has a vocabulary of 384 tokens, the model's has 512"),
        (draft_config(target), 2, "a draft model runs with tensor_parallel_size 1 only"),
        (draft_config(target / "missing"), 1, "no such file or directory"),
        (
            draft_config(target, "typical_acceptance_sampler"),
            1,
            "acceptance_method must be one of ['target_draw', 'rejection_sampler'], got "
            "'typical_acceptance_sampler'",
        ),
    ):
        with pytest.raises(ValueError) as caught:
            draft_model_path(settings(speculative, tp), str(target), config)
        assert words in str(caught.value) and "\n" not in str(caught.value)


def test_the_plan_hands_the_draft_and_its_acceptance_method_to_rank_0(
    runner: ModelRunner, target: Path, other: Path
) -> None:
    """The launch resolves the draft into the worker's config; the worker builds its Drafter
    from it, with vLLM's rejection sampler only when asked, which deterministic mode refuses."""
    for deterministic, method in (
        (False, "target_draw"),
        (False, "rejection_sampler"),
        (True, "target_draw"),
    ):
        fields: dict[str, Any] = {"model.path": str(target), "model.deterministic": deterministic}
        spec = {"scheduler.speculative_config": draft_config(other, method)}
        plan = plan_engine(build_settings(None, **fields, **spec), str(target))
        child = next(c for c in plan.spec.children if c.name.startswith("worker"))
        config = msgspec.msgpack.decode(child.config, type=WorkerConfig)
        assert config.draft_model_path == str(other)
        drafter = _drafter(config, runner, None)  # no run: its weights are not kept
        assert isinstance(drafter, Drafter)
        if drafter.runner.weight_slot is not None:  # kept for restarts of a run we are not
            drafter.runner.weight_slot.remove()
        assert drafter.rejection_sampling == (method == "rejection_sampler")
        assert _drafter(msgspec.structs.replace(config, rank=1), runner, None) is None
    fields = {"model.path": str(target), "model.deterministic": True}
    spec = {"scheduler.speculative_config": draft_config(other, "rejection_sampler")}
    with pytest.raises(ValueError, match='"rejection_sampler" cannot run in deterministic mode'):
        plan_engine(build_settings(None, **fields, **spec), str(target))
