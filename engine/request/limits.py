"""What one request may ask for, checked where it enters the engine, before any actor sees it.

Everything a request carries travels through several actors (the prompt and stop strings to the
tokenizer, scheduler and detokenizer; each sample through every step), so what grows with a
request's input is bounded here, with a 400 naming the field and the limit. The waiting queue is
bounded in samples, not requests: a request with n samples holds n sequences' worth of work.

Pure functions: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.messages.params import SamplingParams
from engine.request.outputs import EngineError
from engine.settings.schema import LimitsSettings
from engine.structured.spec import check_structured_outputs


def check_params(
    params: SamplingParams, limits: LimitsSettings, max_model_len: int, max_logprobs: int = 20
) -> None:
    """Raise EngineError(400) naming the field when `params` is invalid or over a limit
    (`max_logprobs`: model.max_logprobs, for logprobs and prompt_logprobs alike)."""
    try:
        params.validate()
        if params.structured_outputs is not None:
            check_structured_outputs(params.structured_outputs, limits.max_grammar_chars)
    except ValueError as exc:  # the message starts with the field's name
        field = str(exc).split(" ", 1)[0].split(".", 1)[0]
        raise EngineError(str(exc), 400, field) from None
    asked_for = (("logprobs", params.logprobs), ("prompt_logprobs", params.prompt_logprobs))
    for field, asked in asked_for:
        if asked is not None and asked > max_logprobs:
            raise EngineError(
                f"{field} is {asked}, more than this server allows "
                f"({max_logprobs}, model.max_logprobs / --max-logprobs)",
                400,
                field,
            )
    _within(params.n, limits.max_n, "n", "limits.max_n", "samples")
    _within(len(params.stop), limits.max_stop_strings, "stop", "limits.max_stop_strings", "strings")
    stop_chars = sum(len(stop) for stop in params.stop)
    _within(stop_chars, limits.max_stop_chars, "stop", "limits.max_stop_chars", "characters")
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = min(limits.default_max_tokens or max_model_len, max_model_len)
    if params.n * max_tokens > limits.max_request_tokens:
        raise EngineError(
            f"n x max_tokens is {params.n} x {max_tokens} = {params.n * max_tokens} tokens, over "
            f"the {limits.max_request_tokens} one request may ask for (limits.max_request_tokens; "
            "max_tokens unset counts as limits.default_max_tokens, or max_model_len)",
            400,
            "n",
        )


def check_prompt_size(
    prompt: str | None,
    prompt_token_ids: list[int] | None,
    contents: Iterable[str],
    limits: LimitsSettings,
    max_model_len: int,
) -> None:
    """Refuse prompts that cannot fit max_model_len before paying to tokenize or carry them.

    Token ids are counted exactly. Text is bounded by characters: no tokenizer packs more than
    `max_prompt_chars_per_token` characters per token in practice, so longer text could never fit.
    """
    if prompt_token_ids is not None:
        check_prompt_length(len(prompt_token_ids), None, max_model_len)
    max_chars = max_model_len * limits.max_prompt_chars_per_token
    if prompt is not None and len(prompt) > max_chars:
        message = _too_long_text("the prompt", len(prompt), max_model_len, max_chars)
        raise EngineError(message, 400, "prompt")
    total = sum(len(content) for content in contents)
    if total > max_chars:
        message = _too_long_text("the messages", total, max_model_len, max_chars)
        raise EngineError(message, 400, "messages")


def check_prompt_length(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """The prompt must leave room for output: fewer than max_model_len tokens, and prompt +
    max_tokens within it (pass max_tokens=None for a resumed request, which already has output)."""
    if prompt_len == 0:
        raise EngineError("the prompt is empty: it must have at least one token", 400, "prompt")
    if prompt_len >= max_model_len:
        raise EngineError(
            f"the prompt has {prompt_len} tokens, but max_model_len is {max_model_len}: "
            f"it must have fewer than {max_model_len} tokens to leave room for output",
            400,
            "prompt",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise EngineError(
            f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: "
            f"{prompt_len + max_tokens} exceeds max_model_len {max_model_len}",
            400,
            "max_tokens",
        )


def check_token_ids_named(params: SamplingParams, vocab_size: int) -> None:
    """logit_bias and allowed_token_ids may name only tokens of the vocabulary."""
    largest = params.max_token_id()
    if largest >= vocab_size:
        field = "logit_bias" if largest in (params.logit_bias or {}) else "allowed_token_ids"
        raise EngineError(
            f"{field} names token id {largest}, outside the vocabulary of {vocab_size} tokens "
            f"(ids 0..{vocab_size - 1})",
            400,
            field,
        )


def check_queue(waiting_samples: int, n: int, max_queued_samples: int) -> None:
    """Refuse a request whose samples would take the waiting queue over its limit: 429 while
    the queue is full (retry later), 400 for a request that could never fit."""
    if n > max_queued_samples:
        raise EngineError(
            f"n is {n}, more samples than the waiting queue holds "
            f"(scheduler.max_queued_samples is {max_queued_samples})",
            400,
            "n",
        )
    if waiting_samples + n > max_queued_samples:
        raise EngineError(
            f"too many samples waiting ({waiting_samples} + {n} asked, "
            f"scheduler.max_queued_samples is {max_queued_samples}); retry shortly",
            429,
        )


def _within(value: int, limit: int, field: str, setting: str, unit: str) -> None:
    if value > limit:
        raise EngineError(
            f"{field} has {value} {unit}, over the limit of {limit} ({setting})", 400, field
        )


def _too_long_text(what: str, chars: int, max_model_len: int, max_chars: int) -> str:
    return (
        f"{what} has {chars} characters, more than max_model_len {max_model_len} could ever "
        f"hold (at most {max_chars} characters: max_model_len x "
        "limits.max_prompt_chars_per_token)"
    )
