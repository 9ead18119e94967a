"""A step plan is one frame on a ring: it never grows with a request's input beyond what the
workers have not seen yet, and never outgrows the frame, however big or many the requests."""

from __future__ import annotations

import pytest

from engine.messages.steps import STEP_PLANS
from tests.unit.test_scheduler import (
    Outputs,
    assert_no_state_left,
    expected,
    make,
    run_to_end,
    step,
    submit,
)

STOPS = ["x" * 150 + str(i) for i in range(200)]


def test_a_request_reaches_the_workers_once_whatever_its_samples_and_without_stop_strings() -> None:
    scheduler, worker = make(max_model_len=64, max_num_batched_tokens=64)
    prompt = list(range(1, 20))
    scheduler.add(submit("r", prompt, n=4, max_tokens=3, stop=STOPS))
    plans = []
    outputs = Outputs()
    while (plan := step(scheduler, worker, outputs)) is not None:
        plans.append(plan)
    announced = [request for plan in plans for request in plan.new_requests]
    assert [request.prompt_token_ids for request in announced] == [prompt]
    assert announced[0].params.stop == [] and announced[0].params.n == 4
    assert b"x" * 150 not in b"".join(STEP_PLANS.encode(plan) for plan in plans)
    assert sum(len(plan.new_seqs) for plan in plans) == 4
    for index in range(4):
        assert outputs.tokens["r", index] == expected(prompt, 1, 3, index=index)
    assert_no_state_left(scheduler, worker)


def test_decode_plans_do_not_grow_with_the_context() -> None:
    scheduler, worker = make(num_blocks=256, max_model_len=1000, max_num_batched_tokens=1000)
    scheduler.add(submit("long", list(range(1, 800)), max_tokens=60, ignore_eos=True))
    outputs = Outputs()
    sizes = []
    while (plan := step(scheduler, worker, outputs)) is not None:
        sizes.append(len(STEP_PLANS.encode(plan)))
    decode_sizes = sizes[1:-1]  # past the prefill, before the last plan that retires
    assert max(decode_sizes) < 64, decode_sizes  # a token, a position and a new block at most
    assert len(outputs.tokens["long", 0]) == 60


def test_many_large_requests_are_spread_over_plans_that_each_fit_the_frame() -> None:
    max_plan_bytes = 24 * 1024  # room for about two of these requests' announcements
    scheduler, worker = make(
        num_blocks=2048,
        max_model_len=1000,
        max_num_seqs=64,
        max_num_batched_tokens=64 * 1000,
        max_plan_bytes=max_plan_bytes,
    )
    prompts = {f"r{i}": [(i * 7 + t) % 90 + 1 for t in range(900)] for i in range(24)}
    for request_id, prompt in prompts.items():
        scheduler.add(submit(request_id, prompt, max_tokens=4, ignore_eos=True))
    outputs = run_to_end(scheduler, worker)  # step() checks every plan against the frame
    for request_id, prompt in prompts.items():
        assert outputs.tokens[request_id, 0] == expected(prompt, 1, 4, max_model_len=1000)
    assert_no_state_left(scheduler, worker)


def test_a_request_whose_prompt_and_parameters_could_never_fit_a_plan_is_refused() -> None:
    scheduler, _ = make(max_model_len=64, max_plan_bytes=8192)
    rejected = scheduler.add(submit("huge", [1, 2, 3], stop_token_ids=list(range(5000))))
    assert rejected is not None and rejected.status == 400
    assert "stop_token_ids" in rejected.message and "4096" in rejected.message
    assert not scheduler.has_unfinished_requests


def test_a_plan_frame_that_cannot_hold_one_sequence_of_max_model_len_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="plan of 1000 bytes cannot carry one sequence of max_"):
        make(max_model_len=64, max_plan_bytes=1000)
