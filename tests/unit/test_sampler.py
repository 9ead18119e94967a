from __future__ import annotations

import itertools
import math

import pytest
import torch

from engine.kernels.registry import select_backend
from engine.messages.params import SamplingParams
from engine.model.sampling.sampler import Sampler, _apply_penalties, _top_k_top_p, uniform_noise
from engine.model.step_inputs import SequenceStart

EOS = 3


def new_seq(
    seq_id: int, seed: int = 0, prompt=(1, 2), output=(), **params: object
) -> SequenceStart:
    return SequenceStart(seq_id, list(prompt), list(output), SamplingParams(**params), seed)  # type: ignore[arg-type]


def sampler_with(*seqs: SequenceStart, vocab_size: int = 8) -> Sampler:
    sampler = Sampler(vocab_size, [EOS])
    for seq in seqs:
        sampler.add(seq)
    return sampler


# ---- references: straightforward loops over one row ----------------------------------------------


def reference_allowed(row: list[float], temperature: float, min_p: float, top_k: int, top_p: float):
    """The tokens min_p, then top_k, then top_p leave, with their renormalized probabilities."""
    scaled = [value / temperature for value in row]
    total = sum(math.exp(v) for v in scaled)
    probs = [math.exp(v) / total for v in scaled]
    allowed = [t for t in range(len(row)) if probs[t] >= min_p * max(probs)]
    if 0 < top_k < len(allowed):
        kth = sorted((scaled[t] for t in allowed), reverse=True)[top_k - 1]
        allowed = [t for t in allowed if scaled[t] >= kth]
    mass = sum(probs[t] for t in allowed)
    kept, before = [], 0.0
    for t in sorted(allowed, key=lambda t: -scaled[t]):
        if kept and before >= top_p:
            break
        kept.append(t)
        before += probs[t] / mass
    mass = sum(probs[t] for t in kept)
    return {t: probs[t] / mass for t in kept}


def test_top_k_top_p_masks_match_a_sorted_loop() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(40, 50, generator=generator) * 2
    combinations = list(itertools.product([0, 1, 5, 49], [1.0, 0.9, 0.5, 0.05]))
    for row in range(40):
        k, p = combinations[row % len(combinations)]
        values = logits[row].tolist()
        top_k = k if k else 50
        masked = _top_k_top_p(logits[row : row + 1], [top_k], [p])[0]
        kept = {t for t in range(50) if masked[t] != -math.inf}
        assert kept == set(reference_allowed(values, 1.0, 0.0, k, p)), (k, p)


def test_penalties_follow_the_formulas() -> None:
    vocab = 6
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, -0.5, 2.0]])
    seq = new_seq(
        0,
        prompt=[1, 5],
        output=[2, 3, 3],
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    sampler = sampler_with(seq, vocab_size=vocab)
    penalized = logits.clone()
    _apply_penalties(penalized, [sampler._seqs[0]], vocab)
    expected = []
    output = [2, 3, 3]
    for token, value in enumerate(logits[0].tolist()):
        if token in (1, 5, 2, 3):  # prompt or output: repetition penalty
            value = value / 2.0 if value > 0 else value * 2.0
        value -= 0.25 * output.count(token) + 0.5 * (token in output)
        expected.append(value)
    assert penalized[0].tolist() == pytest.approx(expected)


@pytest.mark.parametrize("frequency_penalty", [0.0, 0.25])
def test_repeat_last_n_penalizes_only_the_last_tokens_of_prompt_and_output(
    frequency_penalty: float,
) -> None:
    """llama.cpp's window: with repeat_last_n 3 the context is the prompt's last token and the
    two of output (5, 2, 3); 1, early in the prompt, and 4, never seen, keep their logits. Alone
    it edits those logits in place; beside a frequency penalty, through the vocabulary's masks:
    the same rule either way."""
    vocab = 6
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, -0.5, 2.0], [1.0, -2.0, 3.0, 0.5, -0.5, 2.0]])
    window = dict(repetition_penalty=2.0, repeat_last_n=3, frequency_penalty=frequency_penalty)
    seq = new_seq(0, prompt=[1, 1, 5], output=[2, 3], **window)
    sampler = sampler_with(seq, new_seq(1, prompt=[1, 1, 5], output=[2, 3]), vocab_size=vocab)
    penalized = logits.clone()
    _apply_penalties(penalized, [sampler._seqs[0], sampler._seqs[1]], vocab)
    expected = [v / 2.0 if t in (2, 3, 5) else v for t, v in enumerate(logits[0].tolist())]
    expected = [v - frequency_penalty * (t in (2, 3)) for t, v in enumerate(expected)]
    assert penalized[0].tolist() == pytest.approx(expected)
    assert penalized[1].tolist() == logits[1].tolist()  # a row without penalties is untouched
    with pytest.raises(ValueError, match="repeat_last_n must be an integer >= 1"):
        SamplingParams(repeat_last_n=0).validate()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_greedy_takes_the_argmax_and_ignores_padded_vocabulary_columns(backend: str) -> None:
    argmax_rows = select_backend(torch.device("cpu"), backend).argmax_rows
    sampler = Sampler(8, [EOS], argmax_rows=argmax_rows)
    for seq in (new_seq(0, temperature=0.0), new_seq(1, temperature=0.0)):
        sampler.add(seq)
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0, 0, 0, 0, 0, 99.0], [7.0, 5, 1, 0, 0, 0, 0, 0, 99]])
    tokens, logprobs = sampler.sample([0, 1], logits)
    assert (tokens, logprobs) == ([1, 0], None)
    assert sampler.output_token_ids(0) == [1]


def test_eos_and_stop_tokens_are_masked_until_min_tokens() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 9.0, 8.0, 0, 0, 0]])  # EOS (3), then 4
    sampler = sampler_with(
        new_seq(0, temperature=0.0, min_tokens=2),
        new_seq(1, temperature=0.0, min_tokens=2, stop_token_ids=[4]),
        new_seq(2, temperature=0.0, min_tokens=2, ignore_eos=True, stop_token_ids=[4]),
    )
    runs = [sampler.sample([0, 1, 2], logits.repeat(3, 1))[0] for _ in range(3)]
    assert [run[0] for run in runs] == [4, 4, EOS]
    assert [run[1] for run in runs] == [2, 2, EOS]
    assert [run[2] for run in runs] == [EOS, EOS, EOS]  # ignore_eos: EOS stays allowed


def test_logprobs_are_the_raw_log_softmax_whatever_the_processing() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 8, generator=generator)
    sampler = sampler_with(
        new_seq(0, seed=3, temperature=0.5, top_k=3, repetition_penalty=1.5, logprobs=3),
        new_seq(1, temperature=0.0),
    )
    tokens, logprobs = sampler.sample([0, 1], logits)
    assert logprobs is not None
    reference = torch.log_softmax(logits, dim=-1)
    top_values, top_ids = reference[0].topk(3)
    assert logprobs[0].logprob == pytest.approx(reference[0, tokens[0]].item())
    assert logprobs[0].top_token_ids == top_ids.tolist()
    assert logprobs[0].top_logprobs == pytest.approx(top_values.tolist())
    assert logprobs[1].logprob == pytest.approx(reference[1, tokens[1]].item())
    assert logprobs[1].top_token_ids == []


# ---- randomness ----------------------------------------------------------------------------------


def test_seeded_sampling_is_independent_of_batch_composition() -> None:
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(2))
    alone = sampler_with(new_seq(0, seed=42, top_p=0.9))
    crowd = sampler_with(
        new_seq(5, seed=1, temperature=0.3),
        new_seq(0, seed=42, top_p=0.9),
        new_seq(6, seed=7, top_k=2, presence_penalty=1.0, logprobs=2),
    )
    solo_tokens, crowd_tokens = [], []
    for _ in range(20):
        solo_tokens += alone.sample([0], logits)[0]
        crowd_tokens.append(crowd.sample([5, 0, 6], logits.repeat(3, 1))[0][1])
    assert solo_tokens == crowd_tokens
    assert len(set(solo_tokens)) > 1, "twenty draws at T=1 should not all agree"


def test_a_top_k_row_draws_the_same_tokens_in_any_batch() -> None:
    """Rows that all keep few tokens are drawn on their candidates alone (top_k_draw.py): still
    a pure function of (seed, position), whatever the other rows keep."""
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(4))
    defaults = dict(
        temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1, repeat_last_n=64
    )
    alone = sampler_with(new_seq(0, seed=42, **defaults), vocab_size=300)
    crowd = sampler_with(
        new_seq(5, seed=1, temperature=2.0, top_k=200),
        new_seq(0, seed=42, **defaults),
        new_seq(6, seed=7, top_k=2),
        vocab_size=300,
    )
    solo_tokens, crowd_tokens = [], []
    for _ in range(20):
        solo_tokens += alone.sample([0], logits)[0]
        crowd_tokens.append(crowd.sample([5, 0, 6], logits.repeat(3, 1))[0][1])
    assert solo_tokens == crowd_tokens
    assert len(set(solo_tokens)) > 1


def test_a_resumed_sequence_draws_the_same_tokens_it_would_have() -> None:
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(3))
    first = sampler_with(new_seq(0, seed=9, prompt=[1, 2, 3]))
    full = [first.sample([0], logits)[0][0] for _ in range(12)]
    resumed = sampler_with(new_seq(77, seed=9, prompt=[1, 2, 3], output=full[:5]))
    rest = [resumed.sample([77], logits)[0][0] for _ in range(7)]
    assert rest == full[5:]


def test_seeds_give_different_streams() -> None:
    columns = torch.arange(1000).unsqueeze(0)
    noise = uniform_noise([1, 2, 1], [10, 10, 11], columns)
    assert not torch.equal(noise[0], noise[1])
    assert not torch.equal(noise[0], noise[2])
    assert noise.min().item() > 0.0 and noise.max().item() < 1.0
    assert noise.mean().item() == pytest.approx(0.5, abs=0.02)


@pytest.mark.parametrize(
    ("temperature", "min_p", "top_k", "top_p"),
    [
        (1.0, 0.0, 0, 1.0),
        (0.7, 0.0, 0, 1.0),
        (1.3, 0.0, 3, 1.0),
        (1.0, 0.0, 0, 0.8),
        (1.0, 0.3, 0, 1.0),
        (0.9, 0.1, 4, 0.9),
        (1.2, 0.2, 5, 0.85),
    ],
)
def test_many_seeds_sample_the_filtered_softmax(
    temperature: float, min_p: float, top_k: int, top_p: float
) -> None:
    draws = 6000
    row = [1.0, 0.2, -0.5, 1.5, 0.0, -1.0]
    sampler = Sampler(6, [])
    for seed in range(draws):
        params = dict(temperature=temperature, min_p=min_p, top_k=top_k, top_p=top_p)
        sampler.add(new_seq(seed, seed=seed, **params))  # type: ignore[arg-type]
    tokens, _ = sampler.sample(list(range(draws)), torch.tensor([row]).repeat(draws, 1))
    wanted = reference_allowed(row, temperature, min_p, top_k, top_p)
    for token in range(6):
        frequency = tokens.count(token) / draws
        probability = wanted.get(token, 0.0)
        sigma = math.sqrt(max(probability * (1 - probability), 1e-12) / draws)
        assert abs(frequency - probability) <= 5 * sigma, (token, frequency, probability)


def test_a_vocabulary_of_several_groups_is_sampled_in_proportion() -> None:
    # 700 tokens: three groups of 256 (the last one partial) in the two-level draw.
    draws, vocab = 8000, 700
    row = torch.full((vocab,), -30.0)
    favourites = {5: 1.0, 255: 0.5, 256: 1.2, 511: 0.0, 699: 0.8}
    for token, value in favourites.items():
        row[token] = value
    row[300:320] = -2.0  # a spread-out tail inside the middle group
    sampler = Sampler(vocab, [])
    for seed in range(draws):
        sampler.add(new_seq(seed, seed=seed))
    tokens, _ = sampler.sample(list(range(draws)), row.repeat(draws, 1))
    probs = torch.softmax(row, dim=-1)
    for token in [*favourites, 300]:
        probability = probs[token].item()
        sigma = math.sqrt(probability * (1 - probability) / draws)
        assert abs(tokens.count(token) / draws - probability) <= 5 * sigma, token
    tail = sum(1 for token in tokens if 300 <= token < 320) / draws
    assert tail == pytest.approx(probs[300:320].sum().item(), abs=0.02)


# ---- errors --------------------------------------------------------------------------------------


def test_an_unknown_sequence_or_a_misshaped_batch_is_a_clear_error() -> None:
    sampler = sampler_with(new_seq(0))
    with pytest.raises(ValueError, match="seq_id 4, which was never added"):
        sampler.sample([4], torch.zeros(1, 8))
    with pytest.raises(ValueError, match=r"shape \[2, >= 8\]"):
        sampler.sample([0, 0], torch.zeros(1, 8))
    with pytest.raises(ValueError, match="fewer than vocab_size 8"):
        sampler.sample([0], torch.zeros(1, 4))


def test_removed_sequences_are_forgotten() -> None:
    sampler = sampler_with(new_seq(0), new_seq(1))
    sampler.remove([0, 12])
    assert len(sampler) == 1
    with pytest.raises(ValueError, match="seq_id 0"):
        sampler.sample([0], torch.zeros(1, 8))
