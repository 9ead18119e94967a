"""What one request may ask for: every limit refuses with 400 naming the field and the setting,
and the waiting queue counts samples."""

from __future__ import annotations

import asyncio
import logging
import re

import msgspec
import pytest

from engine.messages.params import SamplingParams, StructuredOutputsParams
from engine.request.grammar_admission import admit_constraint
from engine.request.limits import (
    check_params,
    check_prompt_size,
    check_queue,
    check_token_ids_named,
)
from engine.request.outputs import EngineError
from engine.settings.schema import LimitsSettings

LIMITS = LimitsSettings(max_n=8, max_stop_strings=4, max_stop_chars=40, max_request_tokens=1000)
MAX_MODEL_LEN = 256


def refusal(**params: object) -> EngineError:
    with pytest.raises(EngineError) as caught:
        check_params(SamplingParams(**params), LIMITS, MAX_MODEL_LEN)  # type: ignore[arg-type]
    return caught.value


def test_a_request_within_every_limit_is_accepted() -> None:
    check_params(SamplingParams(n=8, max_tokens=125, stop=["a" * 10] * 4), LIMITS, MAX_MODEL_LEN)


@pytest.mark.parametrize(
    ("params", "param", "setting"),
    [
        ({"n": 9}, "n", "limits.max_n"),
        ({"n": 20000, "max_tokens": 1}, "n", "limits.max_n"),
        ({"stop": ["x"] * 5}, "stop", "limits.max_stop_strings"),
        ({"stop": ["x" * 41]}, "stop", "limits.max_stop_chars"),
        ({"n": 8, "max_tokens": 126}, "n", "limits.max_request_tokens"),
        ({"n": 4, "max_tokens": None}, "n", "limits.max_request_tokens"),  # counts max_model_len
    ],
)
def test_each_limit_refuses_with_400_naming_the_field_and_the_setting(
    params: dict[str, object], param: str, setting: str
) -> None:
    error = refusal(**params)
    assert error.status == 400 and error.param == param
    assert setting in error.message


def test_an_invalid_value_still_names_its_field() -> None:
    error = refusal(temperature=-1.0)
    assert error.status == 400 and error.param == "temperature"


def test_the_queue_counts_samples_and_asks_to_retry_when_full() -> None:
    check_queue(waiting_samples=6, n=4, max_queued_samples=10)
    with pytest.raises(EngineError) as full:
        check_queue(waiting_samples=7, n=4, max_queued_samples=10)
    assert full.value.status == 429
    with pytest.raises(EngineError) as never:  # could never fit, however long it waits
        check_queue(waiting_samples=0, n=11, max_queued_samples=10)
    assert never.value.status == 400 and never.value.param == "n"


def test_prompts_that_could_never_fit_are_refused_before_tokenizing() -> None:
    max_chars = MAX_MODEL_LEN * LIMITS.max_prompt_chars_per_token
    check_prompt_size("x" * max_chars, None, [], LIMITS, MAX_MODEL_LEN)
    for prompt, ids, contents, param in [
        ("x" * (max_chars + 1), None, [], "prompt"),
        (None, None, ["x" * max_chars, "y"], "messages"),
        (None, [1] * MAX_MODEL_LEN, [], "prompt"),
    ]:
        with pytest.raises(EngineError) as caught:
            check_prompt_size(prompt, ids, contents, LIMITS, MAX_MODEL_LEN)
        assert caught.value.status == 400 and caught.value.param == param
        assert str(MAX_MODEL_LEN) in caught.value.message


def test_a_constraint_that_cannot_be_enforced_is_refused_before_any_compute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO)
    huge_regex = "(a{1000}){1000}"
    for spec, problem in (
        (StructuredOutputsParams(json={"type": "nonsense"}), "nonsense"),
        (StructuredOutputsParams(regex="(ab"), "unclosed group"),
        (StructuredOutputsParams(grammar="root ::= missing"), "missing"),
        # Past the grammar library's limits: these were answered 200 and unconstrained.
        (StructuredOutputsParams(choice=[f"c{i}" for i in range(2500)]), "max_items_in_row 2,000"),
        (StructuredOutputsParams(regex=huge_regex), "initial_lexer_fuel 100,000"),
    ):
        check_params(SamplingParams(structured_outputs=spec), LIMITS, MAX_MODEL_LEN)  # cheap
        with pytest.raises(EngineError) as caught:
            asyncio.run(admit_constraint(spec))
        assert caught.value.status == 400 and caught.value.param == "structured_outputs"
        assert problem in caught.value.message
    refusals = [r.getMessage() for r in caplog.records if r.name.endswith("grammar_admission")]
    assert len(refusals) == 5 and all(re.search(r"\d+ characters, sha256 \w+", r) for r in refusals)
    assert "met llguidance's max_items_in_row" in refusals[3]
    assert not any(s in r for r in caplog.messages for s in (huge_regex, "(ab", "c2499", "missing"))
    for spec, problem in (
        (StructuredOutputsParams(regex="a", choice=["a"]), "exactly one"),
        (StructuredOutputsParams(regex="a", structural_tag="{}"), "structural_tag"),
    ):
        error = refusal(structured_outputs=spec)
        assert error.status == 400 and error.param == "structured_outputs"
        assert problem in error.message
    small = msgspec.structs.replace(LIMITS, max_grammar_chars=500)
    with pytest.raises(EngineError, match=r"has 501 characters.*limits.max_grammar_chars"):
        params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a" * 501))
        check_params(params, small, MAX_MODEL_LEN)
    accepted = StructuredOutputsParams(choice=[f"c{i}" for i in range(1999)])
    check_params(SamplingParams(structured_outputs=accepted), LIMITS, MAX_MODEL_LEN)
    asyncio.run(admit_constraint(accepted))


def test_token_controls_are_checked_against_their_ranges_and_the_vocabulary() -> None:
    assert refusal(logit_bias={3: 101.0}).param == "logit_bias"
    assert refusal(allowed_token_ids=[]).param == "allowed_token_ids"
    assert refusal(bad_words=["  "]).param == "bad_words"
    with pytest.raises(EngineError) as error:
        check_token_ids_named(SamplingParams(allowed_token_ids=[1, 600]), 512)
    assert error.value.param == "allowed_token_ids" and "600" in error.value.message
    check_token_ids_named(SamplingParams(logit_bias={511: 1.0}), 512)
