"""Tool calling: `tools` / `tool_choice` → the chat template's tools and, for `required` or a
named function, a JSON constraint on the answer (as vLLM builds it); answers → `tool_calls`.

`auto` leaves the answer free and reads calls out of its text with the server's
--tool-call-parser: hermes (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen)
or llama3_json (the answer is `{"name": ..., "parameters": {...}}`, several joined by `;`).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from engine.http.openai.errors import ApiError
from engine.http.openai.protocol import NamedToolChoice, ToolIn
from engine.messages.params import StructuredOutputsParams

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_HERMES_START = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"  # Llama 3's opening of a tool call


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=lambda: "call_" + secrets.token_hex(12))


@dataclass
class ToolPlan:
    """How a chat request's answer is turned into tool calls."""

    mode: str  # "auto", "required" or "named" (tool_choice "none" plans nothing)
    names: list[str]
    parser: str | None = None  # for "auto": the server's --tool-call-parser

    def streamable(self, text: str) -> str:
        """What of an unfinished answer is surely plain content (the rest may become calls)."""
        if self.mode != "auto":
            return ""
        if self.parser == "hermes":
            start = text.find(_HERMES_START)
            return text[:start] if start >= 0 else _held(text, _HERMES_START)
        if self.parser == "llama3_json":
            head = text.lstrip()
            if not head or head.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(head):
                return ""
        return text

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a finished answer."""
        if self.mode == "named":
            return None, [ToolCall(self.names[0], _compact(text))]
        if self.mode == "required":
            try:
                items = json.loads(text)
                calls = [ToolCall(item["name"], json.dumps(item["parameters"])) for item in items]
            except (json.JSONDecodeError, KeyError, TypeError):
                return text, []  # cut short (max_tokens): not a call
            return None, calls
        if self.parser == "hermes":
            return _hermes(text)
        if self.parser == "llama3_json":
            return _llama3_json(text)
        return text, []


def plan_tools(
    tools: list[ToolIn] | None,
    choice: str | NamedToolChoice | None,
    parallel_tool_calls: bool | None = None,
) -> tuple[ToolPlan | None, StructuredOutputsParams | None]:
    """The request's tool plan and the constraint its tool_choice asks for (ApiError naming
    the field when tool_choice is not one the request can have). An "auto" plan reads calls
    with the server's parser, which the response builder sets."""
    tools = tools or []
    names = [tool.function.name for tool in tools]
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise ApiError(
                400,
                f"tool_choice names function {choice.function.name!r}, which is not in tools "
                f"({', '.join(names) or 'none given'})",
                param="tool_choice",
            )
        tool = tools[names.index(choice.function.name)]
        schema = tool.function.parameters or {"type": "object"}
        plan = ToolPlan("named", [tool.function.name])
        return plan, StructuredOutputsParams(json=schema)
    if choice not in ("none", "auto", "required"):
        raise ApiError(
            400,
            f"tool_choice must be none, auto, required or a named function, got {choice!r}",
            param="tool_choice",
        )
    if choice == "none":
        return None, None
    if not tools:
        raise ApiError(400, f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice == "auto":
        return ToolPlan("auto", names), None
    calls: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {
            "type": "object",
            "anyOf": [
                {
                    "properties": {
                        "name": {"type": "string", "enum": [tool.function.name]},
                        "parameters": tool.function.parameters or {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for tool in tools
            ],
        },
    }
    if parallel_tool_calls is False:
        calls["maxItems"] = 1
    return ToolPlan("required", names), StructuredOutputsParams(json=calls)


def template_tools(tools: list[ToolIn] | None) -> list[dict[str, Any]] | None:
    """`tools` as chat templates take them (OpenAI's shape, plain dicts). With tool_choice
    "none" too, as vLLM does by default: the model still sees them (it may not call them)."""
    if not tools:
        return None
    out = []
    for tool in tools:
        function: dict[str, Any] = {"name": tool.function.name}
        if tool.function.description is not None:
            function["description"] = tool.function.description
        function["parameters"] = tool.function.parameters or {"type": "object"}
        out.append({"type": "function", "function": function})
    return out


def template_kwargs(tools: list[ToolIn] | None) -> dict[str, Any]:
    """The chat template's variables for `tools`: {"tools": [...]}, or none without tools."""
    shaped = template_tools(tools)
    return {} if shaped is None else {"tools": shaped}


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except json.JSONDecodeError:
        return text  # cut short by max_tokens: returned as generated


def _hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for match in _HERMES.finditer(text):
        try:
            call = json.loads(match.group(1))
            calls.append(ToolCall(str(call["name"]), json.dumps(call.get("arguments", {}))))
        except (json.JSONDecodeError, KeyError, TypeError):
            return text, []  # not a well-formed call: the text is the answer
    if not calls:
        return text, []
    content = text[: text.index(_HERMES_START)]
    return content or None, calls


def _held(text: str, tag: str) -> str:
    """`text` less any ending that could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return text[:-size]
    return text


def _llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):
        try:
            call = json.loads(part)
            arguments = call.get("parameters", call.get("arguments", {}))
            calls.append(ToolCall(str(call["name"]), json.dumps(arguments)))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return text, []
    return None, calls
