from __future__ import annotations

import logging

import pytest

from engine.messages.params import SamplingParams
from engine.messages.steps import STEP_PLANS, NewSeq, SeqChunk, StepPlan


def _plan() -> StepPlan:
    return StepPlan(
        step_id=7,
        new_seqs=[NewSeq(1, [5, 6, 7], [], SamplingParams(temperature=0.0), seed=3)],
        chunks=[SeqChunk(1, [5, 6, 7], 0, [0], True)],
        finished_seq_ids=[],
    )


def test_a_plan_survives_the_wire_unchanged() -> None:
    plan = _plan()
    assert STEP_PLANS.decode(STEP_PLANS.encode(plan)) == plan


def test_a_malformed_frame_is_logged_counted_and_skipped(caplog: pytest.LogCaptureFixture) -> None:
    good = STEP_PLANS.encode(_plan())
    before = STEP_PLANS.decode_errors
    with caplog.at_level(logging.ERROR):
        decoded = STEP_PLANS.decode_many([b"\xc1garbage", good, b"\x93\x01"])
    assert decoded == [_plan()]
    assert STEP_PLANS.decode_errors == before + 2
    assert "step-plan" in caplog.text


def test_invalid_sampling_params_name_the_field() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=1.5).validate()
