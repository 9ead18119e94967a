"""Sampling parameters: the public `SamplingParams` and what travels with a request."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import msgspec

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on a logit_bias value


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A constraint on a completion's text, vLLM's StructuredOutputsParams: exactly one of a JSON
    schema, any JSON object, a regular expression, a choice of strings or a grammar (Lark, or
    GBNF as llama.cpp writes it)."""

    json: str | dict[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # vLLM's options. JSON is always generated without free whitespace (what
    # disable_any_whitespace asks for); the others are refused, not silently ignored.
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def unsupported(self) -> list[str]:
        """Options set that this engine does not implement."""
        return [
            name
            for name, is_set in (
                ("disable_additional_properties", self.disable_additional_properties),
                ("whitespace_pattern", self.whitespace_pattern is not None),
                ("structural_tag", self.structural_tag is not None),
            )
            if is_set
        ]

    def kinds(self) -> list[str]:
        """The constraint's kinds that are set (valid: exactly one)."""
        present = {
            "json": self.json is not None,
            "json_object": bool(self.json_object),
            "regex": self.regex is not None,
            "choice": self.choice is not None,
            "grammar": self.grammar is not None,
        }
        return [name for name, is_set in present.items() if is_set]


POOLING_TYPES = ("LAST", "MEAN")
POOLER_CONFIG_KEYS = ("pooling_type", "normalize")  # what model.pooler_config may set


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An embedding request (vLLM's pooling runner): the prompt is prefilled and its final
    hidden states (after the final norm) are pooled into one vector instead of sampling.
    LAST takes the last prompt token's, MEAN averages every prompt position's."""

    pooling_type: str = "LAST"
    normalize: bool = True  # scaled to unit length (L2), as vLLM's default for embeddings

    @classmethod
    def from_config(cls, text: str) -> PoolingParams:
        """model.pooler_config: '' (LAST, normalized) or vLLM's JSON, e.g. '{"pooling_type":
        "MEAN", "normalize": true}'; ValueError saying what is wrong."""
        if not text.strip():
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"must be a JSON object: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"must be a JSON object, got {text!r}")
        unknown = sorted(set(raw) - set(POOLER_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"has unknown key(s) {unknown}; known: {list(POOLER_CONFIG_KEYS)}")
        kind = raw.get("pooling_type", "LAST")
        if not isinstance(kind, str) or kind.upper() not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {list(POOLING_TYPES)}, got {kind!r}")
        normalize = raw.get("normalize", True)
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize must be true or false, got {normalize!r}")
        return cls(pooling_type=kind.upper(), normalize=normalize)


class LoRARequest(msgspec.Struct, frozen=True):
    """A LoRA adapter to generate with, as vLLM's: its served name, a number naming it (any
    positive int, unique per adapter) and its PEFT directory (engine/model/lora/files.py)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


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
    # repetition_penalty looks at the last this many tokens of prompt + output (llama.cpp's and
    # Ollama's repeat_last_n); None: at all of them (vLLM's rule).
    repeat_last_n: int | None = None
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
    # Token-level controls (vLLM's names), applied batch-wide in the sampler on worker rank 0.
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # never completed (tokenized by the worker, as vLLM)
    # Set: an embedding request. Its one sample runs one step (max_tokens 1), and its output
    # carries the pooled vector; the token sampled beside it is not the answer.
    pooling: PoolingParams | None = None
    # The LoRA adapter the request runs with (set by the engine from the request's model name
    # or LLM.generate's lora_request); None: the base model.
    lora_request: LoRARequest | None = None

    def validate(self) -> None:
        """Raise ValueError naming the offending field and its allowed range."""
        self._validate_lengths_and_sampling()
        self._validate_outputs_and_controls()

    def _validate_lengths_and_sampling(self) -> None:
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
            self.repeat_last_n is None or self.repeat_last_n >= 1,
            "repeat_last_n",
            self.repeat_last_n,
            "an integer >= 1 (or null: the whole prompt and output)",
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

    def _validate_outputs_and_controls(self) -> None:
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
        if self.structured_outputs is not None:
            kinds = self.structured_outputs.kinds()
            _check(
                len(kinds) == 1,
                "structured_outputs",
                kinds,
                "exactly one of json, json_object, regex, choice, grammar",
            )
        for token_id, bias in (self.logit_bias or {}).items():
            _check(token_id >= 0, "logit_bias", token_id, "keyed by token ids >= 0")
            _check(
                -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                "logit_bias",
                bias,
                f"values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            )
        if self.allowed_token_ids is not None:
            _check(
                bool(self.allowed_token_ids) and min(self.allowed_token_ids) >= 0,
                "allowed_token_ids",
                self.allowed_token_ids,
                "a non-empty list of token ids >= 0",
            )
        for stop in self.stop:  # an empty stop string would end every sample at once
            _check(bool(stop), "stop", stop, "strings that are not empty")
        for word in self.bad_words or []:
            _check(bool(word.strip()), "bad_words", word, "words that are not blank")
        if self.pooling is not None:
            kind = self.pooling.pooling_type
            _check(kind in POOLING_TYPES, "pooling_type", kind, f"one of {list(POOLING_TYPES)}")
            _check(self.n == 1, "n", self.n, "1 for an embedding request")
            _check(
                self.max_tokens == 1, "max_tokens", self.max_tokens, "1 for an embedding request"
            )

    def max_token_id(self) -> int:
        """The largest token id the request's controls name (-1: none); checked against the
        vocabulary where it is known."""
        named = [*(self.logit_bias or {}), *(self.allowed_token_ids or [])]
        return max(named, default=-1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, field: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"{field} must be {expected}, got {value!r}")


# generation_config.json key → SamplingParams field (vLLM's list, and llama.cpp's window)
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "repeat_last_n": "repeat_last_n",
    "max_new_tokens": "max_tokens",
}


def generation_defaults(config: Mapping[str, Any]) -> dict[str, Any]:
    """SamplingParams field → value for what a generation config sets; ValueError naming the
    field and its allowed range for a value a request could not have."""
    defaults = {
        field: config[key]
        for key, field in GENERATION_CONFIG_KEYS.items()
        if config.get(key) is not None
    }
    try:
        msgspec.convert(defaults, SamplingParams).validate()
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None
    return defaults


def override_generation_config(text: str) -> dict[str, Any]:
    """vLLM's --override-generation-config: a JSON object of generation_config keys, as
    SamplingParams fields; '' is none. ValueError saying what is wrong."""
    if not text.strip():
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"must be a JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"must be a JSON object, got {text!r}")
    unknown = sorted(set(data) - set(GENERATION_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"has unknown key(s) {unknown}; known: {list(GENERATION_CONFIG_KEYS)}")
    return generation_defaults(data)
