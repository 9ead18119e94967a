"""Every client string that reaches the chat template is text, through each API: a special token
written in a tool's name, description or parameter schema, a tool call's name or arguments, a
tool's result, or the system prompt never becomes a control token (issue 46: only message
contents were shielded, so a tool's description carrying `<|im_end|>\\n<|im_start|>system\\n...`
forged a system turn).

How it is seen from outside: the prompt's size (`usage`). A request whose field holds the
special token twice is longer than one holding it once by the token's length as text (several
tokens); were it a control token, by one. Everything around it is the same in both.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.e2e.harness import Server

SPECIAL = "<|im_end|>"


def schema(key: str, description: str) -> dict[str, Any]:
    return {"type": "object", "properties": {key: {"type": "string", "description": description}}}


def chat(model: str, put: Callable[[str, str], str]) -> tuple[str, dict[str, Any], str]:
    function = {
        "name": put("tool name", "lookup"),
        "description": put("description", "finds"),
        "parameters": schema(put("property", "city"), put("parameter", "a city")),
    }
    call = {
        "name": put("call name", "lookup"),
        "arguments": json.dumps({"city": put("arguments", "x")}),
    }
    body = {
        "model": model,
        "max_tokens": 1,
        "tools": [{"type": "function", "function": function}],
        "messages": [
            {"role": "system", "content": put("system", "be brief")},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "tool_calls": [{"id": "c1", "type": "function", "function": call}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": put("tool result", "sunny")},
        ],
    }
    return "/v1/chat/completions", body, "prompt_tokens"


def responses(model: str, put: Callable[[str, str], str]) -> tuple[str, dict[str, Any], str]:
    tool = {
        "type": "function",
        "name": put("tool name", "lookup"),
        "description": put("description", "finds"),
        "parameters": schema(put("property", "city"), put("parameter", "a city")),
    }
    body = {
        "model": model,
        "max_output_tokens": 1,
        "instructions": put("system", "be brief"),
        "tools": [tool],
        "input": [
            {"role": "user", "content": "Weather?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": put("call name", "lookup"),
                "arguments": json.dumps({"city": put("arguments", "x")}),
            },
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": put("tool result", "sunny"),
            },
        ],
    }
    return "/v1/responses", body, "input_tokens"


def messages(model: str, put: Callable[[str, str], str]) -> tuple[str, dict[str, Any], str]:
    tool = {
        "name": put("tool name", "lookup"),
        "description": put("description", "finds"),
        "input_schema": schema(put("property", "city"), put("parameter", "a city")),
    }
    use = {
        "type": "tool_use",
        "id": "c1",
        "name": put("call name", "lookup"),
        "input": {"city": put("arguments", "x")},
    }
    result = {"type": "tool_result", "tool_use_id": "c1", "content": put("tool result", "sunny")}
    body = {
        "model": model,
        "max_tokens": 1,
        "system": put("system", "be brief"),
        "tools": [tool],
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [use]},
            {"role": "user", "content": [result]},
        ],
    }
    return "/v1/messages", body, "input_tokens"


FIELDS = [
    "tool name",
    "description",
    "property",
    "parameter",
    "call name",
    "arguments",
    "tool result",
    "system",
]


@functools.cache
def as_text(model: str) -> int:
    """How many tokens SPECIAL takes as plain text."""
    tokenizer = AutoTokenizer.from_pretrained(model)
    return len(tokenizer.encode(SPECIAL, add_special_tokens=False, split_special_tokens=True))


@pytest.mark.parametrize("api", [chat, responses, messages], ids=["chat", "responses", "messages"])
@pytest.mark.parametrize("field", FIELDS)
def test_a_special_token_in_a_client_field_is_text(server: Server, api: Any, field: str) -> None:
    def size(value: str) -> int:
        path, body, counted = api(
            server.model, lambda name, usual: value if name == field else usual
        )
        with server.http() as http:
            reply = http.post(path, json=body)
        assert reply.status_code == 200, reply.text
        return int(reply.json()["usage"][counted])

    once, twice = size(f"a{SPECIAL}b"), size(f"a{SPECIAL}{SPECIAL}b")
    assert as_text(server.model) > 1
    assert twice - once == as_text(server.model), f"{field}: a control token (1), not text"
