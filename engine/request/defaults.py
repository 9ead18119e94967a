"""A model's sampling defaults from its `generation_config.json`, as vLLM's
`--generation-config auto` reads them: a request's own fields win; `vllm` ignores the file;
a directory path reads that directory's file instead of the model's.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

import msgspec

from engine.messages.params import SamplingParams

# generation_config.json key → SamplingParams field (vLLM's list)
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
# The SamplingParams fields a model's defaults may set.
DEFAULTABLE_FIELDS = frozenset(_FIELDS.values())


def load_generation_defaults(mode: str, model_path: str) -> dict[str, Any]:
    """SamplingParams field → default, for `model.generation_config` = auto | vllm | PATH."""
    if mode == "vllm":
        return {}
    folder = Path(model_path if mode == "auto" else mode).expanduser()
    path = folder if folder.is_file() else folder / "generation_config.json"
    if not path.is_file():
        if mode != "auto":
            raise ValueError(f"model.generation_config: no generation_config.json at {path}")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"model.generation_config: cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"model.generation_config: {path} does not hold a JSON object")
    defaults = {field: data[key] for key, field in _FIELDS.items() if data.get(key) is not None}
    try:  # checked once here: a request cannot be blamed for its model's defaults
        msgspec.convert(defaults, SamplingParams).validate()
    except (msgspec.ValidationError, ValueError) as e:
        raise ValueError(f"model.generation_config: {path} holds an invalid default: {e}") from None
    return defaults


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
