"""Anthropic Messages API request structs (/v1/messages), decoded by msgspec as protocol.py's.
Unknown fields are ignored."""

from __future__ import annotations

from typing import Any

import msgspec

from engine.http.openai.protocol import Count


class TextBlock(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ContentBlock(msgspec.Struct, kw_only=True):
    """A text, tool_use (an assistant's call) or tool_result (the user's answer to one) block."""

    type: str  # checked in messages_api, to name the choices
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[TextBlock] | None = None  # tool_result
    is_error: bool = False  # tool_result


class MessageIn(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentBlock]


class Tool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # custom (or unset); Anthropic's server tools are not served


class ToolChoice(msgspec.Struct, kw_only=True):
    type: str  # auto | any | tool | none
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(msgspec.Struct, kw_only=True):
    model: str  # required, as in Anthropic's API
    messages: list[MessageIn]
    max_tokens: Count
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Count | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """/v1/messages/count_tokens: what a Messages request's prompt is made of."""

    model: str
    messages: list[MessageIn]
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
