"""OpenAI Responses API request structs (/v1/responses), decoded by msgspec as protocol.py's.

Unknown fields are ignored, as in protocol.py; the vLLM sampling extensions it accepts on
/v1/responses (top_k, min_p, repetition_penalty, seed) are accepted here too.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.http.openai.protocol import Count, Seed


class InputPart(msgspec.Struct, kw_only=True):
    type: str  # input_text | output_text (checked in responses_api, to name the choices)
    text: str | None = None


class InputItem(msgspec.Struct, kw_only=True):
    """A message (role, content), an earlier function call or a function call's output."""

    type: str = "message"
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | None = None  # function_call_output


class FunctionTool(msgspec.Struct, kw_only=True):
    type: str = "function"
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(msgspec.Struct, kw_only=True):
    type: str
    name: str | None = None


class TextFormat(msgspec.Struct, kw_only=True):
    type: str = "text"  # text | json_object | json_schema
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    input: str | list[InputItem]
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    background: bool = False
    # vLLM's extensions
    top_k: Count | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Seed | None = None
