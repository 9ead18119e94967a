"""OpenAI's Responses API and Anthropic's Messages API, through the official `openai` and
`anthropic` clients on the shared server: their typed models and stream accumulators are the
reference the answers and events must satisfy. The model has random weights: every checked
output is one a constraint makes exact (a forced tool call, a JSON schema), never a particular
answer; prompt sizes are checked against transformers' chat template."""

from __future__ import annotations

import functools
import json
import os
import signal
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.conftest import openai_client
from tests.e2e.harness import API_KEY, Server, wait_until
from tests.holds import HOLD_TEXT

WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
COLOUR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
    "required": ["colour"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai_client(server, timeout=60.0) as c:
        yield c


@pytest.fixture(scope="module")
def claude(server: Server) -> Iterator[anthropic.Anthropic]:
    """The `anthropic` client, authenticating with its own x-api-key header."""
    with anthropic.Anthropic(
        base_url=server.url, api_key=API_KEY, timeout=60.0, max_retries=0
    ) as c:
        yield c


def forced_tool_use(model: str) -> dict[str, Any]:
    """A /v1/messages request whose answer is a call of get_weather with valid arguments."""
    tool = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER_PARAMS}
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [tool],
        "tool_choice": {"type": "tool", "name": "get_weather"},
        "max_tokens": 60,
        "extra_body": {"temperature": 0.0},  # this client has no field for it
    }


@functools.cache
def tokenizer(model: str) -> Any:
    return AutoTokenizer.from_pretrained(model)


def template_tokens(
    model: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
) -> int:
    """The prompt's size as transformers lays the conversation out with the chat template."""
    text = tokenizer(model).apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )
    return len(tokenizer(model)(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------- Responses API


def test_responses_text_streamed_and_not(client: openai.OpenAI, server: Server) -> None:
    request: dict[str, Any] = {
        "model": server.model,
        "instructions": "Be brief.",
        "input": "Say something.",
        "max_output_tokens": 8,
        "temperature": 0.0,
    }
    whole = client.responses.create(**request)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.output[0].type == "message"
    expected_prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say something."},
    ]
    assert whole.usage is not None
    assert whole.usage.input_tokens == template_tokens(server.model, expected_prompt)
    assert 0 < whole.usage.output_tokens <= 8

    # The client's own accumulator checks the events' order and item/content indices.
    with client.responses.stream(**request) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        streamed = stream.get_final_response()
    assert "".join(deltas) == streamed.output_text == whole.output_text
    assert streamed.usage is not None and streamed.usage.output_tokens == whole.usage.output_tokens
    assert streamed.status == whole.status


def test_responses_previous_response_id_continues_the_conversation(
    client: openai.OpenAI, server: Server
) -> None:
    first = client.responses.create(
        model=server.model, input="Hello.", max_output_tokens=4, temperature=0.0
    )
    second = client.responses.create(
        model=server.model, input="And then?", previous_response_id=first.id, max_output_tokens=2
    )
    # The second prompt is the first turn (its input and its answer) and the new input, as
    # the chat template lays them out.
    conversation = [
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.usage is not None
    assert second.usage.input_tokens == template_tokens(server.model, conversation)

    # A stored response is retrieved as it was answered, and deleted; one not stored is not found.
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    unstored = client.responses.create(
        model=server.model, input="Hi.", max_output_tokens=1, store=False
    )
    for gone in (first.id, unstored.id):
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve(gone)
        assert missing.value.body["param"] == "response_id"  # type: ignore[index]

    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(
            model=server.model, input="x", previous_response_id="resp_nope", max_output_tokens=1
        )
    assert "resp_nope" in unknown.value.message
    assert unknown.value.body["param"] == "previous_response_id"  # type: ignore[index]


def test_responses_bad_request_gets_an_openai_error(client: openai.OpenAI, server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(
            model=server.model,
            input=[{"role": "robot", "content": "hi"}],  # type: ignore[list-item, typeddict-item]
        )
    assert bad.value.body["param"] == "input[0].role"  # type: ignore[index]
    assert "robot" in bad.value.message


# ---------------------------------------------------------------- Messages API


def test_messages_text_streamed_and_not(claude: anthropic.Anthropic, server: Server) -> None:
    request: dict[str, Any] = {
        "model": server.model,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "extra_body": {"temperature": 0.0},  # this client has no field for it
    }
    whole = claude.messages.create(**request)
    assert whole.type == "message" and whole.role == "assistant"
    assert whole.stop_reason in ("end_turn", "max_tokens")
    (block,) = whole.content
    assert block.type == "text" and block.text
    expected_prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Say something."},
    ]
    assert whole.usage.input_tokens == template_tokens(server.model, expected_prompt)
    # count_tokens: the same prompt's size, without running it; with a tool, as the template
    # lays out the tool's OpenAI form
    count = claude.messages.count_tokens(
        model=server.model, system="Be brief.", messages=request["messages"]
    )
    assert count.input_tokens == whole.usage.input_tokens
    weather = forced_tool_use(server.model)
    with_tool = claude.messages.count_tokens(
        model=server.model, messages=weather["messages"], tools=weather["tools"]
    )
    function = {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS}
    tools = [{"type": "function", "function": function}]
    assert with_tool.input_tokens == template_tokens(server.model, weather["messages"], tools)

    with claude.messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == whole.content[0].text  # type: ignore[union-attr]
    assert [(b.type, b.text) for b in streamed.content] == [("text", text)]  # type: ignore[union-attr]
    assert streamed.stop_reason == whole.stop_reason
    assert streamed.usage.input_tokens == whole.usage.input_tokens
    assert streamed.usage.output_tokens == whole.usage.output_tokens

    # The recorded trace holds the chat request it ran as, which `engine replay` can send again.
    request_id = "chatcmpl-" + whole.id.removeprefix("msg_")

    def recorded() -> list[dict[str, Any]]:
        lines = server.extra["trace"].read_text().split("\n")[:-1]  # whole lines only
        return [r for r in map(json.loads, lines) if r["request_id"] == request_id]

    (record,) = wait_until(recorded, timeout=10)
    assert record["endpoint"] == "chat_completions"
    assert record["body"]["messages"][-1] == {"role": "user", "content": "Say something."}


def test_messages_errors_have_anthropics_shape(claude: anthropic.Anthropic, server: Server) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        claude.messages.create(
            model=server.model,
            max_tokens=4,
            messages=[{"role": "system", "content": "x"}],  # type: ignore[typeddict-item]
        )
    assert bad.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "'messages[0].role' must be user or assistant, got 'system'",
        },
    }
    wrong_key = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with wrong_key, pytest.raises(anthropic.AuthenticationError) as denied:
        wrong_key.messages.create(
            model=server.model, max_tokens=4, messages=[{"role": "user", "content": "x"}]
        )
    assert denied.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad_count:
        claude.messages.count_tokens(model=server.model, messages=[])
    assert bad_count.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]

    # Anthropic's API takes the key as x-api-key, as its older clients send it (the client
    # installed here sends a bearer token).
    body = {"model": server.model, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    for key, status in (("wrong", 401), (API_KEY, 200)):
        answer = httpx.post(
            server.url + "/v1/messages", json=body, headers={"x-api-key": key}, timeout=60.0
        )
        assert answer.status_code == status, answer.text
    assert answer.json()["type"] == "message"


def check_messages_forced_tool_use(claude: anthropic.Anthropic, model: str) -> None:
    """Run by tests/e2e/test_structured_outputs.py, on its server, whose grammar backend is
    warm by then (the first grammar of a server loads its tokenizer: about 10 s here)."""
    request = forced_tool_use(model)
    tool = request["tools"][0]
    whole = claude.messages.create(**request)
    assert whole.stop_reason == "tool_use"
    (use,) = whole.content
    assert use.type == "tool_use" and use.name == "get_weather"
    assert set(use.input) == {"city", "unit"} and use.input["unit"] in ("celsius", "fahrenheit")  # type: ignore[index, arg-type]
    with claude.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    (streamed_use,) = streamed.content
    assert streamed_use.type == "tool_use" and streamed_use.input == use.input
    assert streamed.stop_reason == "tool_use"

    # The tool's result, answered in a user turn, goes into the next prompt.
    follow_up = claude.messages.create(
        model=model,
        max_tokens=2,
        tools=[tool],  # type: ignore[list-item]
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [use.model_dump()]},  # type: ignore[list-item]
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"},
                ],
            },
        ],
    )
    call = {
        "id": use.id,
        "type": "function",
        "function": {"name": use.name, "arguments": use.input},
    }
    conversation = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny"},
    ]
    function = {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMS}
    tools = [{"type": "function", "function": function}]
    assert follow_up.usage.input_tokens == template_tokens(model, conversation, tools)


def check_responses_forced_tool_call_and_json_schema(client: openai.OpenAI, model: str) -> None:
    """Run by tests/e2e/test_structured_outputs.py, as check_messages_forced_tool_use."""
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS}
    called = client.responses.create(
        model=model,
        input="Weather?",
        tools=[tool],
        max_output_tokens=60,  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0.0,
    )
    (call,) = called.output
    assert call.type == "function_call" and call.name == "get_weather"
    arguments = json.loads(call.arguments)
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")

    # The call's result continues the conversation stored under the first response's id.
    answered = client.responses.create(
        model=model,
        previous_response_id=called.id,
        max_output_tokens=2,
        tools=[tool],  # type: ignore[list-item]
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
    )
    assert answered.previous_response_id == called.id
    arguments_object = {"name": "get_weather", "arguments": arguments}
    conversation = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": arguments_object},
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]
    function = {"name": "get_weather", "parameters": WEATHER_PARAMS}
    tools = [{"type": "function", "function": function}]
    assert answered.usage is not None
    assert answered.usage.input_tokens == template_tokens(model, conversation, tools)

    fmt = {"type": "json_schema", "name": "colour", "schema": COLOUR_SCHEMA, "strict": True}
    with client.responses.stream(
        model=model,
        input="A colour?",
        text={"format": fmt},
        max_output_tokens=30,  # type: ignore[typeddict-item]
    ) as stream:
        final = stream.get_final_response()
    assert json.loads(final.output_text)["colour"] in ("red", "green", "blue")


def test_a_streamed_message_survives_a_detokenizer_kill(
    claude: anthropic.Anthropic, server: Server
) -> None:
    request: dict[str, Any] = {
        "model": server.model,
        # Held (tests/holds.py): the stream is still running when the detokenizer dies.
        "messages": [{"role": "user", "content": "Count." + HOLD_TEXT}],
        "max_tokens": 96,
        "extra_body": {"temperature": 0.0},  # this client has no field for it
    }
    undisturbed = claude.messages.create(**request)
    (detokenizer,) = [a for a in server.admin("actors") if a["name"] == "detokenizer"]
    with claude.messages.stream(**request) as stream:
        texts = iter(stream.text_stream)
        first = next(texts)
        os.kill(detokenizer["pid"], signal.SIGKILL)
        rest = "".join(texts)
        final = stream.get_final_message()
    assert rest, "the stream ended before the kill: nothing was tested"
    assert first + rest == undisturbed.content[0].text  # type: ignore[union-attr]
    assert final.usage.output_tokens == undisturbed.usage.output_tokens

    def restarted() -> bool:
        (now,) = [a for a in server.admin("actors") if a["name"] == "detokenizer"]
        replaced = now["restarts"] > detokenizer["restarts"] and now["pid"] is not None
        return bool(replaced and server.admin("health")["ready"])

    wait_until(restarted, timeout=30)


# ---------------------------------------------------------------- chat render


def test_chat_render_is_the_prompt_transformers_renders(server: Server) -> None:
    """vLLM's /v1/chat/completions/render: the prompt a chat request would run, not run."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
    body = {"model": server.model, "messages": messages, "tools": [tool], "temperature": 0.25}
    with server.http() as http:
        rendered = http.post("/v1/chat/completions/render", json=body | {"max_tokens": 7})
        refused = http.post("/v1/chat/completions/render", json=body | {"messages": []})
    assert rendered.status_code == 200, rendered.text
    answer = rendered.json()
    text = tokenizer(server.model).apply_chat_template(
        messages, tools=[tool], add_generation_prompt=True, tokenize=False
    )
    assert answer["prompt"] == text
    assert (
        answer["token_ids"] == tokenizer(server.model)(text, add_special_tokens=False)["input_ids"]
    )
    assert answer["sampling_params"]["temperature"] == 0.25
    assert answer["sampling_params"]["max_tokens"] == 7
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "messages"
