"""Requests the scheduler refuses before they reach a queue, and why (in the client's terms)."""

from __future__ import annotations

from engine.messages.scheduling import SubmitRequest


def rejection_reason(submit: SubmitRequest, max_model_len: int) -> str | None:
    """Why `submit` can never run, naming the values at fault; None if it can."""
    num_prompt = len(submit.prompt_token_ids)
    if num_prompt == 0:
        return "the prompt is empty; at least one prompt token is needed"
    if num_prompt > max_model_len:
        return (
            f"the prompt has {num_prompt} tokens, more than the maximum context length "
            f"max_model_len={max_model_len}"
        )
    if num_prompt == max_model_len:
        return (
            f"the prompt has {num_prompt} tokens, which fills max_model_len={max_model_len}: "
            "no room is left to generate a token"
        )
    if min(submit.prompt_token_ids) < 0:
        return f"prompt token ids must be >= 0, got {min(submit.prompt_token_ids)}"
    try:
        submit.params.validate()
    except ValueError as exc:
        return str(exc)
    if submit.resume is not None:
        indices = [item.index for item in submit.resume]
        bad = [index for index in indices if not 0 <= index < submit.params.n]
        if bad:
            return f"resume sample indices must be in [0, {submit.params.n}), got {bad}"
        if len(set(indices)) != len(indices):
            return f"resume lists a sample index twice: {sorted(indices)}"
    return None
