"""Requests the scheduler refuses before they reach a queue, and why (in the client's terms).

The root's request policy (engine/request/) has checked the sampling parameters and limits of
every request, and the tokenizer its prompt; this checks what the scheduler alone relies on (the
prompt's length against the KV a sequence may hold, what one message may carry, the samples a
resubmission resumes), with the same rules and words.
"""

from __future__ import annotations

from engine.messages.failures import RequestFailed
from engine.messages.scheduling import SubmitRequest
from engine.request.limits import check_prompt_length
from engine.request.outputs import EngineError
from engine.scheduler.requests import Request

# What one prompt token's logprobs may take in a message, text included (a generous bound: id,
# logprob and token text for the token and each alternative).
PROMPT_LOGPROB_BYTES = 16
ALTERNATIVE_BYTES = 48


def rejection_reason(
    submit: SubmitRequest, max_model_len: int, max_message_bytes: int | None = None
) -> str | None:
    """Why `submit` can never run, naming the values at fault; None if it can.

    `max_message_bytes`: what one message between actors may carry; a request's prompt
    logprobs travel in one (with its first token), so they must fit."""
    top = submit.params.prompt_logprobs
    if top is not None and max_message_bytes is not None:
        size = len(submit.prompt_token_ids) * (PROMPT_LOGPROB_BYTES + ALTERNATIVE_BYTES * (top + 1))
        if size > max_message_bytes:
            return (
                f"prompt_logprobs={top} on a prompt of {len(submit.prompt_token_ids)} tokens "
                f"would take about {size} bytes, more than one message may carry "
                f"({max_message_bytes}): ask for fewer alternatives or score a shorter prompt"
            )
    try:  # the KV a request needs: its prompt must leave room for output
        check_prompt_length(len(submit.prompt_token_ids), None, max_model_len)
    except EngineError as exc:
        return str(exc)
    if min(submit.prompt_token_ids) < 0:
        return f"prompt token ids must be >= 0, got {min(submit.prompt_token_ids)}"
    if submit.resume is not None:
        indices = [item.index for item in submit.resume]
        bad = [index for index in indices if not 0 <= index < submit.params.n]
        if bad:
            return f"resume sample indices must be in [0, {submit.params.n}), got {bad}"
        if len(set(indices)) != len(indices):
            return f"resume lists a sample index twice: {sorted(indices)}"
    return None


def announcement_too_large(request: Request, room: int) -> str | None:
    """Why `request` cannot be sent to the workers: a plan must carry it with a sequence's
    history and block table beside it, in `room` bytes."""
    if request.announcement_bytes <= room:
        return None
    return (
        f"the request's prompt and sampling parameters take {request.announcement_bytes} "
        f"bytes to send to the workers, more than a step may carry "
        f"({room}): shorten the prompt or stop_token_ids"
    )


def failed(request_id: str, epoch: int, status: int, message: str, actor: str) -> RequestFailed:
    return RequestFailed(
        request_id=request_id, epoch=epoch, status=status, message=message, actor=actor
    )
