"""Structured outputs, token controls, tool calling and reasoning through the real `openai`
client (issue 15). The model has random weights: every check is one a constraint makes exact
(the text matches the schema / regex / choice), never a particular answer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from tests.e2e.conftest import openai_client, server_args
from tests.e2e.harness import API_KEY, Server, served
from tests.e2e.test_responses_and_messages_api import (
    check_messages_forced_tool_use,
    check_responses_forced_tool_call_and_json_schema,
)


class Pet(BaseModel):
    name: str = Field(max_length=8)
    kind: Literal["cat", "dog", "bird"]
    age: int = Field(ge=0, le=30)


WEATHER_PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER_PARAMS,
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["utc", "local"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
CODE = r"[a-z]{3}-[0-9]{2}"
COLOURS = ["red", "green", "blue"]
ANSWERS = ("yes", "no", "maybe")
USER = [{"role": "user", "content": "Tell me something."}]


@pytest.fixture(scope="module")
def server(model_args: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("structured")
    args = server_args(
        model_args, None, "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"
    )
    with served(args, work, name="structured") as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai_client(server, timeout=120.0) as c:
        yield c


@pytest.fixture
def model(server: Server) -> str:
    return server.model


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120.0)


def test_parse_with_a_pydantic_model_returns_a_valid_object_for_every_choice(
    client: openai.OpenAI, model: str
) -> None:
    completion = client.chat.completions.parse(
        model=model,
        messages=USER,  # type: ignore[arg-type]
        response_format=Pet,
        max_tokens=200,
        n=2,
        temperature=1.0,
        seed=7,
    )
    for choice in completion.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)


def test_json_object_output_parses(client: openai.OpenAI, model: str) -> None:
    # A random model rarely closes an object by chance: a bias on "}" makes it close the first
    # one it may, and then the grammar allows only EOS (finish_reason stop).
    close = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("}")
    completion = client.chat.completions.create(
        model=model,
        messages=USER,  # type: ignore[arg-type]
        response_format={"type": "json_object"},
        logit_bias={str(close): 100},
        max_tokens=300,
        temperature=0.0,
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content or ""), dict)


def test_regex_and_choice_are_met_exactly_whole_and_streamed(
    client: openai.OpenAI, model: str
) -> None:
    for extra, check in (
        ({"structured_outputs": {"regex": CODE}}, lambda text: re.fullmatch(CODE, text)),
        ({"guided_choice": COLOURS}, lambda text: text in COLOURS),
        (
            {"guided_grammar": 'root ::= "yes" | "no" | "maybe"'},
            lambda t: t in ("yes", "no", "maybe"),
        ),
    ):
        whole = client.chat.completions.create(
            model=model,
            messages=USER,
            max_tokens=50,
            n=2,
            temperature=1.0,
            seed=3,  # type: ignore[arg-type]
            extra_body=extra,
        )
        assert all(check(c.message.content) for c in whole.choices), whole
        texts = ["", ""]
        for chunk in client.chat.completions.create(
            model=model,
            messages=USER,
            max_tokens=50,
            n=2,
            temperature=1.0,
            seed=3,  # type: ignore[arg-type]
            extra_body=extra,
            stream=True,
        ):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        assert texts == [c.message.content for c in whole.choices]
    completion = client.completions.create(
        model=model,
        prompt="Code:",
        max_tokens=50,
        extra_body={"structured_outputs": {"regex": CODE}},
    )
    assert re.fullmatch(CODE, completion.choices[0].text)


def test_unconstrained_requests_in_a_mixed_batch_are_unchanged(
    client: openai.OpenAI, model: str
) -> None:
    prompts = [f"Request {i} goes" for i in range(3)]

    def plain(prompt: str) -> str:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0.0)
        return out.choices[0].text

    def constrained(i: int) -> str:
        out = client.chat.completions.create(
            model=model,
            messages=USER,
            max_tokens=200,
            temperature=1.0,
            seed=i,  # type: ignore[arg-type]
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "pet",
                    "schema": Pet.model_json_schema() | {"additionalProperties": False},
                },
            },
        )
        return out.choices[0].message.content or ""

    alone = [plain(p) for p in prompts]
    with ThreadPoolExecutor(6) as pool:
        mixed = [pool.submit(plain, p) for p in prompts]
        pets = [pool.submit(constrained, i) for i in range(3)]
        assert [f.result() for f in mixed] == alone
        for future in pets:
            Pet.model_validate_json(future.result())


def test_named_and_required_tool_choice_return_calls_that_validate(
    client: openai.OpenAI, model: str
) -> None:
    named = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=TOOLS,
        max_tokens=200,
        temperature=0.0,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    choice = named.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls or []
    assert [call.function.name for call in calls] == ["get_weather"]  # type: ignore[union-attr]
    arguments = json.loads(calls[0].function.arguments)  # type: ignore[union-attr]
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")

    required = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=TOOLS,
        max_tokens=200,
        tool_choice="required",  # type: ignore[arg-type]
        parallel_tool_calls=False,
        temperature=1.0,
        seed=5,
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    assert call.function.name in ("get_weather", "get_time")  # type: ignore[union-attr]
    json.loads(call.function.arguments)  # type: ignore[union-attr]

    streamed = list(
        client.chat.completions.create(
            model=model,
            messages=USER,
            tools=TOOLS,
            max_tokens=200,
            stream=True,
            temperature=0.0,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
        )
    )
    deltas = [c.delta.tool_calls for chunk in streamed for c in chunk.choices if c.delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(deltas[0][0].function.arguments) == arguments  # type: ignore[union-attr, arg-type]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_a_conversation_with_tool_results_runs_through_the_template(
    client: openai.OpenAI, model: str
) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'},
    }
    without = client.chat.completions.create(model=model, messages=USER, max_tokens=4)  # type: ignore[arg-type]
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees, rain"},
    ]
    answer = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=TOOLS,
        max_tokens=4,  # type: ignore[arg-type]
    )
    assert answer.usage is not None and without.usage is not None
    # The tools, the call and its result all reached the prompt.
    assert answer.usage.prompt_tokens > without.usage.prompt_tokens + 40


def test_auto_tool_calls_are_read_by_the_hermes_parser(client: openai.OpenAI, model: str) -> None:
    # The random model writes a Hermes call because a regex makes it.
    regex = (
        r'<tool_call>\n\{"name": "get_time", "arguments": \{"zone": "(utc|local)"\}\}\n</tool_call>'
    )
    completion = client.chat.completions.create(
        model=model,
        messages=USER,
        tools=TOOLS,
        max_tokens=100,  # type: ignore[arg-type]
        extra_body={"structured_outputs": {"regex": regex}},
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_time"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments)["zone"] in ("utc", "local")  # type: ignore[union-attr]


def test_reasoning_is_split_from_content_whole_and_streamed(
    client: openai.OpenAI, model: str
) -> None:
    regex = r"<think>[a-z ]{3,12}</think>[a-z]{2,6}"
    extra = {"structured_outputs": {"regex": regex}}
    whole = client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=60,
        extra_body=extra,
        temperature=0.0,  # type: ignore[arg-type]
    )
    message = whole.choices[0].message
    reasoning = message.model_extra["reasoning_content"]  # type: ignore[index]
    assert re.fullmatch(r"[a-z ]{3,12}", reasoning)
    assert re.fullmatch(r"[a-z]{2,6}", message.content or "")
    parts = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(
        model=model,
        messages=USER,
        max_tokens=60,
        extra_body=extra,
        temperature=0.0,
        stream=True,  # type: ignore[arg-type]
    ):
        for c in chunk.choices:
            parts["content"] += c.delta.content or ""
            parts["reasoning_content"] += (c.delta.model_extra or {}).get("reasoning_content") or ""
    assert parts == {"reasoning_content": reasoning, "content": message.content}


def test_token_controls(client: openai.OpenAI, model: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model)
    pieces = [tokenizer.decode([300]), tokenizer.decode([301])]
    biased = client.completions.create(
        model=model, prompt="Hello", max_tokens=8, temperature=0.0, logit_bias={"300": 100}
    )
    assert biased.choices[0].text == pieces[0] * 8
    allowed = client.completions.create(
        model=model,
        prompt="Hello",
        max_tokens=8,
        temperature=1.0,
        seed=1,
        extra_body={"allowed_token_ids": [300, 301]},
    )
    text = allowed.choices[0].text
    assert re.fullmatch("(" + "|".join(map(re.escape, pieces)) + ")+", text), text
    banned = pieces[0] + pieces[1]
    clean = client.completions.create(
        model=model,
        prompt="Hello",
        max_tokens=16,
        temperature=1.0,
        seed=1,
        extra_body={"allowed_token_ids": [300, 301], "bad_words": [banned]},
    )
    assert banned not in clean.choices[0].text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"allowed_token_ids": [99999]}, "allowed_token_ids"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
    ],
)
def test_bad_output_controls_are_400_naming_the_field(
    server: Server, body: dict[str, Any], param: str
) -> None:
    response = post(server, "/v1/chat/completions", {"messages": USER, "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.text


@pytest.mark.parametrize(
    ("constraint", "limit"),
    [
        ({"choice": [f"option {i}" for i in range(2500)]}, "max_items_in_row 2,000"),
        ({"regex": "(a{1000}){1000}"}, "initial_lexer_fuel 100,000"),
    ],
    ids=["choice", "regex"],
)
def test_constraints_past_the_grammar_librarys_limits_are_400_naming_the_limit(
    server: Server, constraint: dict[str, Any], limit: str
) -> None:
    """Both were answered 200 with `finish_reason: stop` and text that broke the constraint."""
    body = {"messages": USER, "max_tokens": 4, "structured_outputs": constraint}
    response = post(server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text
    assert limit in response.json()["error"]["message"]


def test_completions_refuse_suffix_and_best_of_then_keep_serving(server: Server) -> None:
    for body, param in (({"suffix": "end"}, "suffix"), ({"best_of": 3}, "best_of")):
        response = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    assert post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}).status_code == 200


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, model: str) -> None:
    def prompt_tokens(**extra: Any) -> int:
        out = client.chat.completions.create(
            model=model,
            messages=USER,
            max_tokens=1,
            extra_body=extra,  # type: ignore[arg-type]
        )
        assert out.usage is not None
        return out.usage.prompt_tokens

    # enable_thinking=False opens the answer with an empty <think></think>, as Qwen3's does.
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": False}) > prompt_tokens()


def test_forced_tool_calls_of_the_responses_and_messages_apis(
    client: openai.OpenAI, server: Server, model: str
) -> None:
    """tests/e2e/test_responses_and_messages_api.py's checks that need a grammar, run here, where
    this module's tests have loaded the grammar backend already (seconds on a server's first)."""
    with anthropic.Anthropic(
        base_url=server.url, api_key=API_KEY, timeout=120.0, max_retries=0
    ) as claude:
        check_messages_forced_tool_use(claude, model)
    check_responses_forced_tool_call_and_json_schema(client, model)
