"""What a request gets for the sampling fields it leaves unset.

As vLLM's `--generation-config`: `auto` reads the model's `generation_config.json`, `vllm` ignores
it, a directory path reads that directory's file instead; `--override-generation-config` (JSON)
is merged over the result. A request's own fields win.

A model whose file sets no sampling field (the default model's GGUF file carries none, nor do
most GGUF files) gets llama.cpp's defaults instead of vLLM's neutral ones (temperature 1.0, no
truncation): at temperature 1.0 a small quantized model answers incoherently, and greedy or
near-greedy decoding falls into loops that run to the end of the context.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from engine.messages.params import (
    GENERATION_CONFIG_KEYS,
    SamplingParams,
    generation_defaults,
    override_generation_config,
)

# The SamplingParams fields a model's defaults may set.
DEFAULTABLE_FIELDS = frozenset(GENERATION_CONFIG_KEYS.values())
# A model "has its own sampling defaults" when its file sets any of these.
_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")

# For a model without sampling defaults: llama.cpp's (common/common.h: temperature 0.8, top-k 40,
# top-p 0.95, min-p 0.05) with Ollama's repeat penalty (1.1 over the last 64 tokens; llama.cpp
# leaves it off), which curbs the loops a small model falls into.
ENGINE_DEFAULTS: dict[str, Any] = {
    "temperature": 0.8,
    "top_k": 40,
    "top_p": 0.95,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "repeat_last_n": 64,
}


@dataclass(frozen=True)
class SamplingDefaults:
    """SamplingParams field → default, and where they came from, in words for the start log
    and `config show`."""

    values: dict[str, Any] = field(default_factory=dict)
    origin: str = "none"
    # llama.cpp's fallback is for sampling: a request that asks for greedy decoding (its own
    # temperature 0) stays greedy, as in vLLM, and takes only the output bound.
    sampled_only: bool = False

    def apply(self, params: SamplingParams, defaulted: Collection[str]) -> SamplingParams:
        """`params` with the default of each field in `defaulted` (those its client left
        unset) that there is one for."""
        if self.sampled_only and params.greedy and "temperature" not in defaulted:
            defaulted = {"max_tokens"} & set(defaulted)
        return with_defaults(params, self.values, defaulted)

    def describe(self) -> str:
        shown = ", ".join(f"{name}={value}" for name, value in self.values.items())
        return f"{shown or 'none'} ({self.origin})"


def load_sampling_defaults(
    mode: str, model_path: str, override: str = "", model_file: Mapping[str, Any] | None = None
) -> SamplingDefaults:
    """The defaults for `model.generation_config` = auto | vllm | PATH, with
    `model.override_generation_config` merged over them; ValueError naming the setting.
    `model_file`: the model's generation config when it is not a file under `model_path` (a
    GGUF file's metadata)."""
    try:
        overrides = override_generation_config(override)
    except ValueError as e:
        raise ValueError(f"model.override_generation_config {e}") from None
    if mode == "vllm":
        return _merged({}, "model.generation_config vllm", overrides)
    if mode == "auto" and model_file is not None:
        found: dict[str, Any] | None = dict(model_file)
        where = "the model's file"
    else:
        folder = Path(model_path if mode == "auto" else mode).expanduser()
        path = folder if folder.is_file() else folder / "generation_config.json"
        found, where = _read(path, required=mode != "auto"), str(path)
    data = found or {}
    try:
        own = generation_defaults(data)  # checked once here: a request cannot be blamed
    except ValueError as e:
        raise ValueError(
            f"model.generation_config: {where} holds an invalid default: {e}"
        ) from None
    if any(data.get(key) is not None for key in _SAMPLING_KEYS):
        return _merged(own, f"the model's, {where}", overrides)
    # The model's own max_new_tokens (if any) still holds beside the engine's sampling defaults.
    origin = "llama.cpp's for sampled requests, as the model sets none; vllm: none"
    return _merged({**ENGINE_DEFAULTS, **own}, origin, overrides, sampled_only=True)


def _merged(
    values: dict[str, Any], origin: str, overrides: dict[str, Any], sampled_only: bool = False
) -> SamplingDefaults:
    if overrides:
        origin += ", with model.override_generation_config"
    return SamplingDefaults({**values, **overrides}, origin, sampled_only)


def _read(path: Path, *, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ValueError(f"model.generation_config: no generation_config.json at {path}")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model.generation_config: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model.generation_config: {path} does not hold a JSON object")
    return data


def with_defaults(
    params: SamplingParams, defaults: dict[str, Any], defaulted: Collection[str]
) -> SamplingParams:
    """`params` with the model's default for each field in `defaulted` (those its client left
    unset) that the model has one for."""
    changes = {field: value for field, value in defaults.items() if field in defaulted}
    return msgspec.structs.replace(params, **changes) if changes else params


def load_chat_template(value: str | None) -> str | None:
    """model.chat_template: a file's text, or the template itself (as vLLM's --chat-template)."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:  # not a template: a path that is not there
        raise ValueError(f"model.chat_template: no such file {value!r} (nor a Jinja template)")
    return value
