"""When a sample is finished, judged right after a token was appended to it."""

from __future__ import annotations

from collections.abc import Container

from engine.scheduler.requests import SequenceState


def finish_reason(
    seq: SequenceState, eos_token_ids: Container[int], max_model_len: int
) -> str | None:
    """ "stop" for a stop token, "length" at max_tokens or max_model_len, else None.

    Stop tokens count only once min_tokens tokens are out (the sampler also masks them until
    then); the length limits always apply.
    """
    params = seq.params
    token = seq.token_ids[-1]
    num_output = seq.num_output_tokens
    if num_output >= params.min_tokens:
        if not params.ignore_eos and token in eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
    if params.max_tokens is not None and num_output >= params.max_tokens:
        return "length"
    if seq.num_tokens >= max_model_len:
        return "length"
    return None
