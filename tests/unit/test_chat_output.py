"""Tool-call and reasoning parsing, stream shaping and the output-control fields of a request:
pure functions, checked without a server."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from engine.http.openai.chat_output import ChatAnswer, split_reasoning
from engine.http.openai.errors import ApiError
from engine.http.openai.output_controls import output_controls, refuse_unimplemented
from engine.http.openai.protocol import ChatCompletionRequest, ChatDelta
from engine.http.openai.tool_calls import ToolPlan, plan_tools, template_tools
from engine.messages.params import StructuredOutputsParams

TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]


def chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return msgspec.json.decode(json.dumps(body), type=ChatCompletionRequest)


def stream(answer: ChatAnswer, text: str) -> tuple[dict[str, str], list[ChatDelta]]:
    """Feed `text` one character at a time; the concatenated deltas and the last one."""
    sent = {"content": "", "reasoning_content": ""}
    deltas = []
    for end in range(1, len(text) + 1):
        delta, _ = answer.delta(text[:end], finished=end == len(text))
        if delta is not None:
            deltas.append(delta)
            sent["content"] += delta.content or ""
            sent["reasoning_content"] += delta.reasoning_content or ""
    return sent, deltas


def test_hermes_calls_are_read_with_the_content_before_them() -> None:
    text = 'Let me see.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    text += '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    content, calls = ToolPlan("auto", ["f", "g"], "hermes").read(text)
    assert content == "Let me see."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    broken = "<tool_call>{not json}</tool_call>"
    assert ToolPlan("auto", ["f"], "hermes").read(broken) == (broken, [])


def test_llama3_json_calls_are_read() -> None:
    text = '<|python_tag|>{"name": "f", "parameters": {"x": 2}}; {"name": "g", "parameters": {}}'
    content, calls = ToolPlan("auto", ["f", "g"], "llama3_json").read(text)
    assert content is None and [c.name for c in calls] == ["f", "g"]
    assert ToolPlan("auto", ["f"], "llama3_json").read("plain words") == ("plain words", [])


def test_a_stream_sends_content_and_reasoning_as_they_come_and_calls_once_whole() -> None:
    text = (
        '<think>hmm, a tool</think>\n\nSure.<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    )
    answer = ChatAnswer(ToolPlan("auto", ["f"], "hermes"), reasoning=True)
    sent, deltas = stream(answer, text)
    assert sent == {"reasoning_content": "hmm, a tool", "content": "Sure."}
    assert all("<" not in (d.content or "") + (d.reasoning_content or "") for d in deltas)
    (last,) = [d for d in deltas if d.tool_calls]
    assert last is deltas[-1] and last.tool_calls is not None
    assert last.tool_calls[0].function.name == "f"
    content, reasoning, calls = ChatAnswer(ToolPlan("auto", ["f"], "hermes"), True).final(text)
    assert (content, reasoning, len(calls)) == ("Sure.", "hmm, a tool", 1)


def test_reasoning_without_its_end_is_content() -> None:
    assert split_reasoning("no thinking here") == (None, "no thinking here")
    sent, _ = stream(ChatAnswer(None, reasoning=True), "<thi plain")
    assert sent == {"content": "<thi plain", "reasoning_content": ""}


def plan_of(req: ChatCompletionRequest) -> tuple[ToolPlan | None, StructuredOutputsParams | None]:
    return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)


def test_tool_choice_plans() -> None:
    plan, constraint = plan_of(chat(tools=TOOLS, tool_choice="required"))
    assert plan is not None and plan.mode == "required" and constraint is not None
    schema = constraint.json
    assert isinstance(schema, dict)
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["f"], ["g"]]
    named = {"type": "function", "function": {"name": "f"}}
    plan, constraint = plan_of(chat(tools=TOOLS, tool_choice=named))
    assert plan is not None and constraint is not None and constraint.json == {"type": "object"}
    assert plan_of(chat(tools=TOOLS, tool_choice="none")) == (None, None)
    # Not called, yet shown to the model, as vLLM does by default.
    shown = template_tools(chat(tools=TOOLS, tool_choice="none").tools)
    assert shown is not None and [t["function"]["name"] for t in shown] == ["f", "g"]
    with pytest.raises(ApiError) as error:
        plan_of(chat(tools=TOOLS, tool_choice={"function": {"name": "h"}}))
    assert error.value.param == "tool_choice"


def test_output_controls_map_the_request_fields_and_name_them() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fields, names = output_controls(
        chat(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            logit_bias={"7": 100, "8": -3},
            bad_words=["no"],
        )
    )
    assert fields["structured_outputs"].json == schema
    assert names == {"structured_outputs": "response_format.json_schema.schema"}
    assert fields["logit_bias"] == {7: 100.0, 8: -3.0}
    assert fields["bad_words"] == ["no"]
    with pytest.raises(ApiError, match="logit_bias keys must be token ids") as key:
        output_controls(chat(logit_bias={"seven": 1}))
    assert key.value.param == "logit_bias"
    regex, names = output_controls(chat(guided_regex="[0-9]+"))
    assert regex["structured_outputs"].regex == "[0-9]+" and names["structured_outputs"] == (
        "guided_regex"
    )
    with pytest.raises(ApiError) as error:
        output_controls(chat(guided_regex="a", structured_outputs={"choice": ["a"]}))
    assert error.value.param == "guided_regex"


def test_fields_that_change_output_are_refused_and_unknown_ones_accepted() -> None:
    refuse_unimplemented(chat(best_of=1, some_new_field=3, modalities=["text"]))
    for fields, param in (
        ({"best_of": 2}, "best_of"),
        ({"modalities": ["audio"]}, "modalities"),
        ({"add_generation_prompt": False}, "add_generation_prompt"),
    ):
        with pytest.raises(ApiError) as error:
            refuse_unimplemented(chat(**fields))
        assert error.value.param == param
