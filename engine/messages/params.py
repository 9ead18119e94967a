"""Sampling parameters: the public `SamplingParams` and what travels with a request."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How to sample one request's completions (names and meanings as vLLM's)."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token; 0 = sampled only
    # Logprobs of the prompt's tokens (each given those before it), with this many top ones.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the offending field and its allowed range."""
        _check(self.n >= 1, "n", self.n, "an integer >= 1")
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            self.max_tokens,
            "an integer >= 1",
        )
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens",
            self.min_tokens,
            f"<= max_tokens ({self.max_tokens})",
        )
        _check(self.temperature >= 0.0, "temperature", self.temperature, "a number >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "a number in (0, 1]")
        _check(self.top_k >= -1, "top_k", self.top_k, "-1, 0 (disabled) or a positive integer")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "a number in [0, 1]")
        _check(
            self.repetition_penalty > 0.0,
            "repetition_penalty",
            self.repetition_penalty,
            "a number > 0",
        )
        _check(
            -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            self.presence_penalty,
            "a number in [-2, 2]",
        )
        _check(
            -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            self.frequency_penalty,
            "a number in [-2, 2]",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= 20,
            "logprobs",
            self.logprobs,
            "an integer in [0, 20]",
        )
        _check(
            self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
            "prompt_logprobs",
            self.prompt_logprobs,
            "an integer in [0, 20]",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, field: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{field} must be {expected}, got {value!r}")
