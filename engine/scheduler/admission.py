"""Requests the scheduler refuses before they reach a queue, and why (in the client's terms).

The root and the tokenizer refuse what they can first (engine/admission.py); this re-checks what
the scheduler relies on, with the same rules and words, since a submission may come from either.
"""

from __future__ import annotations

from engine.admission import check_prompt_length
from engine.messages.scheduling import SubmitRequest
from engine.outputs import EngineError


def rejection_reason(submit: SubmitRequest, max_model_len: int) -> str | None:
    """Why `submit` can never run, naming the values at fault; None if it can."""
    try:
        check_prompt_length(len(submit.prompt_token_ids), None, max_model_len)
        submit.params.validate()
    except (EngineError, ValueError) as exc:
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
