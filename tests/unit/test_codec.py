from __future__ import annotations

import logging

import pytest

from engine.messages.codec import FrameTooLarge, encode_in_frames
from engine.messages.outputs import (
    DETOKENIZER_TO_GATEWAY,
    OutputBatch,
    SampleDeltaText,
    TextStarted,
)
from engine.messages.params import SamplingParams
from engine.messages.steps import STEP_PLANS, NewRequest, NewSeq, PlannedChunk, StepPlan


def _plan() -> StepPlan:
    return StepPlan(
        step_id=7,
        new_requests=[NewRequest(4, [5, 6, 7], SamplingParams(temperature=0.0))],
        new_seqs=[NewSeq(1, 4, [], seed=3)],
        chunks=[PlannedChunk(1, [5, 6, 7], 0, [0], True)],
        finished_seq_ids=[],
        finished_request_keys=[],
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


def test_a_batch_too_big_for_one_frame_is_split_in_order_and_an_item_too_big_fails_alone() -> None:
    started = [TextStarted(f"r{i}-" + "x" * 400, 0) for i in range(6)]
    samples = [SampleDeltaText(f"r{i}", 0, 0, [1], "t", None, None) for i in range(6)]
    parts = [started, samples, []]
    frames = encode_in_frames(DETOKENIZER_TO_GATEWAY, OutputBatch, parts, 1000)
    assert len(frames) > 1 and all(len(frame) <= 1000 for frame in frames)
    batches = [DETOKENIZER_TO_GATEWAY.decode(frame) for frame in frames]
    assert [p for b in batches for p in b.started] == started
    assert [s for b in batches for s in b.samples] == samples
    # Contiguous runs: no frame carries a sample while a later frame still carries a start.
    last_with_started = max(k for k, b in enumerate(batches) if b.started)
    first_with_samples = min(k for k, b in enumerate(batches) if b.samples)
    assert first_with_samples >= last_with_started
    # What fits is one frame, exactly the batch's own encoding.
    assert encode_in_frames(DETOKENIZER_TO_GATEWAY, OutputBatch, parts, 10**6) == [
        DETOKENIZER_TO_GATEWAY.encode(OutputBatch(*parts))
    ]
    with pytest.raises(FrameTooLarge, match="one item takes"):
        encode_in_frames(DETOKENIZER_TO_GATEWAY, OutputBatch, parts, 300)
