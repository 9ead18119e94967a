"""When a sample is finished, judged right after a token was appended to it."""

from __future__ import annotations

from collections.abc import Container

from engine.messages.params import SamplingParams
from engine.scheduler.requests import SequenceState


def max_output_tokens(params: SamplingParams, default_max_tokens: int) -> int | None:
    """A sample's output limit: its max_tokens, or for a request that set none the server's
    limits.default_max_tokens (0: none, as vLLM: only max_model_len ends it)."""
    if params.max_tokens is not None:
        return params.max_tokens
    return default_max_tokens or None


def finish_reason(
    seq: SequenceState,
    eos_token_ids: Container[int],
    max_model_len: int,
    default_max_tokens: int = 0,
) -> str | None:
    """ "stop" for a stop token, "length" at its output limit (max_output_tokens) or
    max_model_len, else None.

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
    limit = max_output_tokens(params, default_max_tokens)
    if limit is not None and num_output >= limit:
        return "length"
    if seq.num_tokens >= max_model_len:
        return "length"
    return None
