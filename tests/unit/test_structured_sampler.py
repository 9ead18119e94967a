"""The sampler's token controls with the real tokenizer of a test checkpoint: grammar bitmasks
(and a matcher rebuilt from output tokens, as after a restart), logit_bias, allowed_token_ids
and bad_words. Logits are random: a constraint must hold whatever the model prefers."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoTokenizer

from engine.messages.params import SamplingParams, StructuredOutputsParams
from engine.model.config import load_model_config
from engine.model.sampling.sampler import Sampler
from engine.model.sampling.token_controls import bad_words_token_ids
from engine.model.step_inputs import SequenceStart
from engine.structured.bitmask import fill_bitmask
from engine.structured.grammars import GrammarService, SequenceMatcher
from engine.structured.limits import ConstraintError
from tests.checkpoints import tiny_checkpoint

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "tags"],
    "additionalProperties": False,
}
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def model() -> str:
    return str(tiny_checkpoint())


@pytest.fixture(scope="module")
def grammars(model: str) -> Iterator[GrammarService]:
    config = load_model_config(model, None)
    service = GrammarService(model, config.vocab_size, list(config.eos_token_ids))
    yield service
    service.close()


def sampler_of(grammars: GrammarService) -> Sampler:
    return Sampler(grammars.vocab_size, grammars.eos_token_ids, grammars)


def run(sampler: Sampler, seq_ids: list[int], steps: int, seed: int) -> list[list[int]]:
    """Sample `steps` tokens for every sequence from seeded random logits."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        logits = torch.randn(len(seq_ids), sampler.vocab_size, generator=generator) * 4
        sampler.sample(seq_ids, logits)
    return [sampler.output_token_ids(seq_id) for seq_id in seq_ids]


def until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    for position, token in enumerate(tokens):
        if token in eos:
            return tokens[: position + 1]
    return tokens


def test_a_json_schema_holds_and_ends_with_eos_beside_an_untouched_row(
    grammars: GrammarService, model: str
) -> None:
    params = SamplingParams(
        temperature=0.0, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    sampler = sampler_of(grammars)
    sampler.add(SequenceStart(1, PROMPT, [], params, 0))
    sampler.add(SequenceStart(2, PROMPT, [], SamplingParams(temperature=0.0), 0))
    generator = torch.Generator().manual_seed(1)
    for _ in range(80):
        logits = torch.randn(2, sampler.vocab_size, generator=generator) * 4
        tokens, _ = sampler.sample([1, 2], logits)
        assert tokens[1] == int(logits[1].argmax())  # the free row is never masked
        if tokens[0] in grammars.eos_token_ids:
            break
    output = sampler.output_token_ids(1)
    assert output[-1] in grammars.eos_token_ids
    text = AutoTokenizer.from_pretrained(model).decode(output[:-1])
    value = json.loads(text)
    assert set(value) == {"name", "ok", "tags"} and len(value["name"]) <= 6


def test_a_matcher_rebuilt_from_output_tokens_masks_as_the_undisturbed_one(
    grammars: GrammarService,
) -> None:
    spec = StructuredOutputsParams(regex=r"(cat|dog|bird)( (cat|dog|bird)){20}")
    params = SamplingParams(temperature=1.0, structured_outputs=spec)
    undisturbed = sampler_of(grammars)
    undisturbed.add(SequenceStart(1, PROMPT, [], params, 42))
    full = run(undisturbed, [1], 30, seed=3)[0]
    for cut in (0, 1, 7, 15):
        # The mask after `cut` tokens: from a fresh matcher fed the delivered tokens, and from
        # one that sampled them step by step (the undisturbed run, replayed).
        rebuilt = SequenceMatcher(grammars.compile(spec)).ready(full[:cut])
        stepped = SequenceMatcher(grammars.compile(spec))
        for end in range(cut + 1):
            matcher = stepped.ready(full[:end])
        masks = fill_bitmask(grammars.executor, [rebuilt, matcher], grammars.vocab_size, [0])
        assert torch.equal(masks[0], masks[1]) and masks[0].any()
        resumed = sampler_of(grammars)
        resumed.add(SequenceStart(1, PROMPT, full[:cut], params, 42))
        generator = torch.Generator().manual_seed(3)
        for _ in range(cut):  # the same logits the undisturbed run saw at the same steps
            torch.randn(1, resumed.vocab_size, generator=generator)
        for _ in range(30 - cut):
            logits = torch.randn(1, resumed.vocab_size, generator=generator) * 4
            resumed.sample([1], logits)
        assert resumed.output_token_ids(1) == full


def test_a_regex_is_met_exactly_under_random_sampling(grammars: GrammarService, model: str) -> None:
    spec = StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{2}")
    params = SamplingParams(temperature=1.0, structured_outputs=spec)
    sampler = sampler_of(grammars)
    for seq_id in range(4):
        sampler.add(SequenceStart(seq_id, PROMPT, [], params, seq_id))
    outputs = run(sampler, list(range(4)), 12, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    for output in outputs:
        text = tokenizer.decode(until_eos(output, grammars.eos_token_ids)[:-1])
        assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", text), text


def test_a_grammar_that_meets_a_library_limit_fails_and_never_ends_as_if_met(
    grammars: GrammarService,
) -> None:
    """A matcher in an error state looked finished: the sequence was given EOS, and the request
    answered 200 with `finish_reason: stop` and text its constraint did not allow."""
    spec = StructuredOutputsParams(regex="(a{1000}){1000}")  # admission refuses it, too
    sampler = sampler_of(grammars)
    sampler.add(SequenceStart(1, PROMPT, [], SamplingParams(structured_outputs=spec), 0))
    logits = torch.zeros(1, grammars.vocab_size)
    sampler.sample([1], logits)  # the first token fits
    for _ in range(2):  # the step fails, and so does its rerun: no EOS is ever sampled
        with pytest.raises(ConstraintError, match="initial_lexer_fuel 100,000"):
            sampler.sample([1], logits)
    assert not set(sampler.output_token_ids(1)) & set(grammars.eos_token_ids)


def test_logit_bias_allowed_token_ids_and_bad_words(grammars: GrammarService, model: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model)
    word = tokenizer.decode([300]) + tokenizer.decode([301])
    assert [300, 301] in bad_words_token_ids(tokenizer, [word])
    sampler = sampler_of(grammars)
    sampler.add(SequenceStart(1, PROMPT, [], SamplingParams(logit_bias={300: 100.0}), 1))
    sampler.add(SequenceStart(2, PROMPT, [], SamplingParams(allowed_token_ids=[300, 301]), 2))
    # Allowed only 300 and 301, with 301 after 300 banned: the pair never occurs.
    banned = SamplingParams(allowed_token_ids=[300, 301], bad_words=[word])
    sampler.add(SequenceStart(3, PROMPT, [], banned, 3))
    biased, allowed, clean = run(sampler, [1, 2, 3], 40, seed=5)
    assert biased == [300] * 40
    assert set(allowed) <= {300, 301} and len(set(allowed)) == 2
    assert set(clean) <= {300, 301}
    assert all(clean[i : i + 2] != [300, 301] for i in range(len(clean) - 1))
