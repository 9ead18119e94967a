"""A scheduler and a step executor driven to the end in one process, as the actors drive them:
the loop the speculative-decoding tests share (n-gram and draft model alike)."""

from __future__ import annotations

from engine.messages.params import SamplingParams
from engine.messages.scheduling import SampleResume, SubmitRequest
from engine.model.step import StepExecutor
from engine.scheduler.scheduler import Scheduler


def run_to_end(
    scheduler: Scheduler,
    executor: StepExecutor,
    requests: dict[str, tuple[list[int], SamplingParams]],
    seeds: dict[str, int],
    resubmit: tuple[str, int] | None = None,
    max_steps: int = 400,
) -> dict[str, list[int]]:
    """Every request's tokens, run to the end; `resubmit` (request, step): that request comes
    again in a new epoch after that step, with its tokens so far, as after an actor restart
    (only the new epoch's tokens count from then on)."""
    for request_id, (prompt, params) in requests.items():
        submit = SubmitRequest(request_id, 0, prompt, params, seeds[request_id])
        assert scheduler.add(submit) is None
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    epochs = dict.fromkeys(requests, 0)
    for step in range(max_steps):
        if resubmit is not None and step == resubmit[1]:
            request_id = resubmit[0]
            prompt, params = requests[request_id]
            resume = [SampleResume(0, list(tokens[request_id]))]
            again = SubmitRequest(request_id, 1, prompt, params, seeds[request_id], resume)
            assert scheduler.add(again) is None
            epochs[request_id] = 1
        plan = scheduler.schedule()
        if plan is None:
            if not scheduler.has_unfinished_requests:
                return tokens
            continue
        for message in executor.run(plan):
            for item in scheduler.update(message).items:  # type: ignore[arg-type]
                if item.epoch == epochs[item.request_id]:
                    tokens[item.request_id] += item.new_token_ids
    raise AssertionError(f"not done after {max_steps} steps")
