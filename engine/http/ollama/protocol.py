"""Ollama's API shapes (docs/api.md of Ollama): the request bodies this server reads and the
answers it writes, field names as Ollama's. Unknown request fields are ignored, as Ollama's
server ignores them; a field of the wrong type is a 400 naming it."""

from __future__ import annotations

from typing import Any

import msgspec

KeepAlive = float | int | str | None


class OllamaMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None


class GenerateBody(msgspec.Struct, kw_only=True):
    model: str = ""
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: bool | str | None = None


class ChatBody(msgspec.Struct, kw_only=True):
    model: str = ""
    messages: list[OllamaMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: KeepAlive = None
    think: bool | str | None = None


class EmbedBody(msgspec.Struct, kw_only=True):
    model: str = ""
    input: str | list[str] = ""
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None
    dimensions: int | None = None


class EmbeddingsBody(msgspec.Struct, kw_only=True):
    model: str = ""
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class ShowBody(msgspec.Struct, kw_only=True):
    model: str = ""
    name: str = ""  # the older field
    verbose: bool = False


class ToolCallOut(msgspec.Struct, kw_only=True):
    function: dict[str, Any]  # {"name": ..., "arguments": {...}}


class MessageOut(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str  # assistant
    content: str
    thinking: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class Timings(msgspec.Struct, kw_only=True):
    """A finished answer's counts and durations (nanoseconds), as Ollama reports them."""

    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0


class GenerateChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    created_at: str
    response: str
    done: bool
    thinking: str | None = None
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ChatChunk(msgspec.Struct, kw_only=True, omit_defaults=True):
    model: str
    created_at: str
    message: MessageOut
    done: bool
    done_reason: str | None = None
    total_duration: int | None = None
    load_duration: int | None = None
    prompt_eval_count: int | None = None
    prompt_eval_duration: int | None = None
    eval_count: int | None = None
    eval_duration: int | None = None


class ModelDetails(msgspec.Struct, kw_only=True):
    parent_model: str = ""
    format: str = ""
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class TagModel(msgspec.Struct, kw_only=True):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails


class RunningModel(msgspec.Struct, kw_only=True):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int = 0
    context_length: int = 0
