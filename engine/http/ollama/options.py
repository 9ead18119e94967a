"""Ollama's request options → the engine's SamplingParams, refused by the engine's own policy.

Each option Ollama documents is mapped onto our field of the same meaning (`num_predict` →
max_tokens, `repeat_penalty` → repetition_penalty, ...); the engine's request policy then checks
it as it checks every API's, and a refusal names Ollama's field (`options.num_predict`). Options
that choose how a model is loaded (GPU layers, threads, mmap) are the server's to set and are
accepted without effect, as Ollama accepts options a runner does not use. Options asking for a
sampler this engine does not have (mirostat, tail-free, typical sampling) are refused when they
would change the answer: a constraint that cannot be honoured is an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.http.openai.errors import ApiError
from engine.messages.params import SamplingParams, StructuredOutputsParams

# Ollama's option -> our SamplingParams field, for options of the same meaning
RENAMED = {
    "num_predict": "max_tokens",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "repeat_penalty": "repetition_penalty",
    "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
    "stop": "stop",
}
# How the model is loaded and run: the server's settings, not a request's
LOAD_OPTIONS = frozenset(
    [
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "embedding_only",
        "num_thread",
        "num_keep",
        "penalize_newline",
    ]
)
# Samplers we do not have: accepted only at the value that turns them off
NEUTRAL = {
    "mirostat": 0,
    "mirostat_tau": None,
    "mirostat_eta": None,
    "tfs_z": 1.0,
    "typical_p": 1.0,
}
_INTEGERS = {"num_predict", "top_k", "repeat_last_n", "seed", "num_ctx", "mirostat"}


@dataclass
class Sampling:
    """A request's sampling, as the engine takes it: the params, the fields the request left
    to the model's defaults, and Ollama's name of each field (for refusals)."""

    params: SamplingParams
    defaulted: frozenset[str]
    field_names: dict[str, str] = field(default_factory=dict)


def sampling_of(
    options: Mapping[str, Any] | None,
    max_model_len: int,
    fmt: str | dict[str, Any] | None = None,
) -> Sampling:
    """SamplingParams of Ollama's `options` and `format`; ApiError naming the option."""
    options = dict(options or {})
    fields: dict[str, Any] = {}
    for name, value in options.items():
        where = f"options.{name}"
        if value is None or name in LOAD_OPTIONS:
            continue
        _check_type(name, value, where)
        if name in RENAMED:
            fields[RENAMED[name]] = _converted(name, value, where)
        elif name == "num_ctx":
            _check_context(value, max_model_len)
        elif name in NEUTRAL:
            _check_neutral(name, value, where)
        else:
            raise ApiError(400, f"unknown option {name!r}", param=where)
    max_tokens = fields.get("max_tokens", "unset")
    if max_tokens is not None and max_tokens != "unset" and max_tokens < 0:
        fields["max_tokens"] = None  # -1: until the context ends; -2: fill it (ours: the same)
    constraint = _format(fmt)
    if constraint is not None:
        fields["structured_outputs"] = constraint
    names = {ours: f"options.{theirs}" for theirs, ours in RENAMED.items()}
    names["structured_outputs"] = "format"
    defaulted = frozenset(ours for ours in set(RENAMED.values()) if ours not in fields)
    try:
        params = SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"invalid options: {e}", param="options") from None
    return Sampling(params, defaulted, names)


def _check_type(name: str, value: Any, where: str) -> None:
    if name == "stop":
        is_list = isinstance(value, list) and all(isinstance(s, str) for s in value)
        if not is_list and not isinstance(value, str):
            raise ApiError(400, f"'{where}' must be a list of strings", param=where)
        return
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(400, f"'{where}' must be a number, got {value!r}", param=where)
    if name in _INTEGERS and value != int(value):
        raise ApiError(400, f"'{where}' must be an integer, got {value!r}", param=where)


def _converted(name: str, value: Any, where: str) -> Any:
    if name == "stop":
        return [value] if isinstance(value, str) else list(value)
    if name in _INTEGERS:
        return int(value)
    return float(value)


def _check_context(value: Any, max_model_len: int) -> None:
    if int(value) > max_model_len:
        raise ApiError(
            400,
            f"'options.num_ctx' {int(value)} is over this model's context of {max_model_len} "
            "tokens (the server's --max-model-len)",
            param="options.num_ctx",
        )


def _check_neutral(name: str, value: Any, where: str) -> None:
    neutral = NEUTRAL[name]
    if neutral is not None and float(value) != float(neutral):
        raise ApiError(
            400,
            f"'{where}' {value!r} asks for a sampler this server does not have; leave it unset "
            f"(or {neutral})",
            param=where,
        )


def _format(fmt: str | dict[str, Any] | None) -> StructuredOutputsParams | None:
    """Ollama's `format`: "json" (any JSON value... an object, as llama.cpp's json grammar
    roots it) or a JSON schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return StructuredOutputsParams(json_object=True)
    if isinstance(fmt, dict):
        return StructuredOutputsParams(json=fmt)
    raise ApiError(400, f"'format' must be \"json\" or a JSON schema, got {fmt!r}", param="format")
