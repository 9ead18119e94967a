"""OpenAI protocol layer without a server: request parsing, error bodies, response shapes."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest

from engine.http.openai.bodies import SSE_DONE, ResponseBuilder
from engine.http.openai.errors import ApiError, api_error_from
from engine.http.openai.parsing import OpenAIRequest, parse_chat, parse_completion
from engine.messages.requests import ChatMessage
from engine.request.grammar_admission import admit_constraint
from engine.request.outputs import (
    CompletionOutput,
    EngineError,
    Logprob,
    RequestOutput,
    TokenLogprob,
)
from engine.request.policy import RequestPolicy, renamed

MODEL = "tiny"
POLICY = RequestPolicy(max_model_len=1024, max_queued_samples=64)


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


def admitted(parse: Any, raw: bytes) -> OpenAIRequest:
    """A body as the server takes it before any actor: parsed, then each engine request through
    the engine's request policy (whose refusal the server answers as api_error_from does)."""
    api: OpenAIRequest = parse(raw, MODEL)
    for request in api.requests:
        try:
            POLICY.apply(request)
            if request.params.structured_outputs is not None:  # as AsyncLLM.submit admits it
                asyncio.run(admit_constraint(request.params.structured_outputs))
        except EngineError as refusal:
            raise api_error_from(renamed(refusal, request.field_names)) from None
    return api


def prompts(api: OpenAIRequest) -> list[Any]:
    """Each engine request's prompt: its text, or its token ids (None for a chat)."""
    return [r.prompt if r.prompt is not None else r.prompt_token_ids for r in api.requests]


def error_of(parse: Any, raw: bytes) -> ApiError:
    with pytest.raises(ApiError) as info:
        admitted(parse, raw)
    error = info.value
    shape = msgspec.json.decode(error.encoded())
    assert set(shape) == {"error"}
    assert set(shape["error"]) == {"message", "type", "param", "code"}
    return error


# ---------------------------------------------------------------- good requests


def test_completion_defaults_follow_openai() -> None:
    req = parse_completion(body(model=MODEL, prompt="hi"), MODEL)
    assert req.kind == "completion" and prompts(req) == ["hi"] and req.requests[0].messages is None
    assert req.params.max_tokens == 16 and req.params.temperature == 1.0 and req.params.n == 1
    assert req.request_id.startswith("cmpl-") and not req.stream and not req.want_logprobs


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("a", ["a"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_all_four_prompt_forms(prompt: Any, expected: list[Any]) -> None:
    req = parse_completion(body(prompt=prompt), MODEL)
    assert prompts(req) == expected
    assert req.model == MODEL  # model may be omitted
    req.name_engine_requests()
    ids = {request.request_id for request in req.requests}
    assert len(ids) == len(expected)


def test_sampling_fields_and_vllm_extensions_reach_sampling_params() -> None:
    raw = body(
        prompt="x",
        max_tokens=5,
        temperature=0.5,
        top_p=0.9,
        n=3,
        stop="END",
        seed=7,
        presence_penalty=0.1,
        frequency_penalty=-0.2,
        logprobs=2,
        user="u",
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        min_tokens=2,
        ignore_eos=True,
        stop_token_ids=[9],
        include_stop_str_in_output=True,
        stream=True,
        stream_options={"include_usage": True},
    )
    req = parse_completion(raw, MODEL)
    p = req.params
    assert (p.max_tokens, p.temperature, p.top_p, p.n, p.seed) == (5, 0.5, 0.9, 3, 7)
    assert (p.presence_penalty, p.frequency_penalty, p.logprobs) == (0.1, -0.2, 2)
    assert (p.top_k, p.min_p, p.repetition_penalty, p.min_tokens) == (40, 0.05, 1.1, 2)
    assert p.stop == ["END"] and p.stop_token_ids == [9]
    assert p.ignore_eos and p.include_stop_str_in_output
    assert req.stream and req.include_usage and req.want_logprobs


def test_chat_messages_text_parts_and_roles() -> None:
    raw = body(
        model=MODEL,
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ],
        max_completion_tokens=4,
        max_tokens=99,
        logprobs=True,
        top_logprobs=3,
    )
    req = parse_chat(raw, MODEL)
    assert req.requests[0].messages == [
        ChatMessage("system", "be brief"),
        ChatMessage("user", "a\nb"),
        ChatMessage("assistant", ""),
    ]
    assert prompts(req) == [None] and req.request_id.startswith("chatcmpl-")
    assert req.params.max_tokens == 4  # max_completion_tokens wins over the legacy name
    assert req.params.logprobs == 3 and req.want_logprobs


def test_chat_without_limit_runs_to_model_length_and_logprobs_off() -> None:
    req = parse_chat(body(messages=[{"role": "user", "content": "x"}]), MODEL)
    assert req.params.max_tokens is None and req.params.logprobs is None
    req = parse_chat(body(messages=[{"role": "user", "content": "x"}], logprobs=True), MODEL)
    assert req.params.logprobs == 0


def test_unknown_request_fields_are_ignored() -> None:
    req = parse_completion(body(prompt="x", best_of=1, logit_bias={}, suffix=None), MODEL)
    assert prompts(req) == ["x"]


# ---------------------------------------------------------------- bad requests


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [
        (b"{", None, "not valid JSON"),
        (b"[1, 2]", None, "Expected `object`"),
        (body(), "prompt", "missing required field 'prompt'"),
        (body(prompt=3.5), "prompt", "prompt"),
        (body(prompt=[1.5]), "prompt[0]", "prompt[0]"),
        (body(prompt=["a", 1]), "prompt", "not a mix"),
        (body(prompt=[]), "prompt", "must not be empty"),
        (body(prompt=""), "prompt", "must not be empty"),
        (body(prompt=[[1], []]), "prompt[1]", "must not be empty"),
        (body(prompt=[1, -2]), "prompt[1]", "must be an integer in [0, 2147483647]"),
        (body(prompt="x", temperature="hot"), "temperature", "Expected `float | null`"),
        (body(prompt="x", temperature=-1), "temperature", ">= 0"),
        (body(prompt="x", top_p=0), "top_p", "(0, 1]"),
        (body(prompt="x", n=0), "n", ">= 1"),
        (body(prompt="x", n="2"), "n", "Expected `int`"),
        (body(prompt="x", max_tokens=0), "max_tokens", ">= 1"),
        (body(prompt="x", max_tokens=2, min_tokens=3), "min_tokens", "<= max_tokens"),
        (body(prompt="x", top_k=-5), "top_k", "top_k"),
        (body(prompt="x", min_p=2), "min_p", "[0, 1]"),
        (body(prompt="x", repetition_penalty=0), "repetition_penalty", "> 0"),
        (body(prompt="x", presence_penalty=3), "presence_penalty", "[-2, 2]"),
        (body(prompt="x", frequency_penalty=-3), "frequency_penalty", "[-2, 2]"),
        (body(prompt="x", logprobs=21), "logprobs", "[0, 20]"),
        (body(prompt="x", stop=["a", ""]), "stop", "strings that are not empty"),
        (body(prompt="x", stop=5), "stop", "Expected `str | array | null`"),
        (body(prompt="x", seed="s"), "seed", "Expected `int | null`"),
        (body(prompt="x", stream="yes"), "stream", "Expected `bool`"),
        (body(prompt="x", stream_options={"include_usage": 1}), "stream_options.include_usage", ""),
        (body(prompt="x", stop_token_ids=["a"]), "stop_token_ids[0]", ""),
    ],
)
def test_bad_completion_requests_name_the_field(
    raw: bytes, param: str | None, fragment: str
) -> None:
    error = error_of(parse_completion, raw)
    assert error.status == 400
    assert error.param == param
    assert error.type == "invalid_request_error"
    assert fragment in error.message


@pytest.mark.parametrize(
    ("fields", "param", "fragment"),
    [
        ({}, "messages", "missing required field 'messages'"),
        ({"messages": []}, "messages", "at least one message"),
        ({"messages": "hi"}, "messages", "Expected `array`"),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "missing required field"),
        ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "system, user"),
        ({"messages": [{"role": "user"}]}, "messages[0].content", "is required"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", ""),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0].type",
            "text part",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
            "requires",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
            "top_logprobs",
            "[0, 20]",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 2}, "logprobs", "bool"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens",
            ">= 1",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens", ">= 1"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"7": 150}},
            "logit_bias",
            "logit_bias must be values in [-100, 100], got 150.0",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "guided_json": "{"},
            "guided_json",
            "guided_json.json is not valid JSON",
        ),
    ],
)
def test_bad_chat_requests_name_the_field(
    fields: dict[str, Any], param: str, fragment: str
) -> None:
    error = error_of(parse_chat, body(**fields))
    assert error.status == 400
    assert error.param == param
    assert fragment in error.message


def test_unknown_model_is_404_naming_both_models() -> None:
    for parse, fields in (
        (parse_completion, {"prompt": "x"}),
        (parse_chat, {"messages": [{"role": "user", "content": "x"}]}),
    ):
        error = error_of(parse, body(model="gpt-9", **fields))
        assert error.status == 404 and error.param == "model" and error.code == "model_not_found"
        assert "gpt-9" in error.message and MODEL in error.message


def test_error_types_and_codes_by_status() -> None:
    assert ApiError(401, "x").code == "invalid_api_key"
    assert ApiError(413, "x").code == "request_too_large"
    too_many = ApiError(429, "x", headers={"Retry-After": "1"})
    assert too_many.type == "rate_limit_error" and too_many.headers["Retry-After"] == "1"
    assert ApiError(500, "x").type == "server_error"


# ---------------------------------------------------------------- response shapes


def out(
    index: int, text: str, ids: list[int], finish: str | None = None, lp: Any = None
) -> CompletionOutput:
    return CompletionOutput(
        index=index, text=text, token_ids=ids, finish_reason=finish, logprobs=lp
    )


def lp_entry(token: str, logprob: float, alts: list[tuple[str, float]]) -> Logprob:
    return Logprob(1, token, logprob, [TokenLogprob(2, t, v) for t, v in alts])


def engine_yields(finished_last: bool = True) -> list[RequestOutput]:
    prompt_ids = [5, 6, 7]
    return [
        RequestOutput(
            "r", "p", prompt_ids, [out(0, "He", [1], lp=[lp_entry("He", -0.1, [("Hi", -2.0)])])]
        ),
        RequestOutput("r", "p", prompt_ids, [out(1, "Yo", [4])]),
        RequestOutput(
            "r",
            "p",
            prompt_ids,
            [
                out(
                    0, "llo", [2, 3], "stop", lp=[lp_entry("l", -0.2, []), lp_entry("lo", -0.3, [])]
                ),
                out(1, "", [], "length"),
            ],
            finished=finished_last,
        ),
    ]


def completion_request(**extra: Any) -> OpenAIRequest:
    return parse_completion(body(prompt="p", n=2, **extra), MODEL)


def test_completion_body_accumulates_deltas_and_counts_usage() -> None:
    prepared = completion_request(logprobs=1)
    builder = ResponseBuilder(prepared)
    for item in engine_yields():
        builder.absorb(0, item)
    shape = json.loads(builder.final_body())
    assert shape["object"] == "text_completion" and shape["model"] == MODEL
    assert shape["id"] == prepared.request_id
    first, second = shape["choices"]
    assert (first["index"], first["text"], first["finish_reason"]) == (0, "Hello", "stop")
    assert (second["index"], second["text"], second["finish_reason"]) == (1, "Yo", "length")
    assert first["logprobs"]["tokens"] == ["He", "l", "lo"]
    assert first["logprobs"]["token_logprobs"] == [-0.1, -0.2, -0.3]
    assert first["logprobs"]["text_offset"] == [0, 2, 3]
    assert first["logprobs"]["top_logprobs"][0] == {"Hi": -2.0, "He": -0.1}
    assert shape["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_chat_body_shapes_message_and_logprobs() -> None:
    prepared = parse_chat(
        body(messages=[{"role": "user", "content": "x"}], n=2, logprobs=True, top_logprobs=1), MODEL
    )
    builder = ResponseBuilder(prepared)
    for item in engine_yields():
        builder.absorb(0, item)
    shape = json.loads(builder.final_body())
    assert shape["object"] == "chat.completion"
    choice = shape["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello"}
    token = choice["logprobs"]["content"][0]
    assert token["token"] == "He" and token["bytes"] == list(b"He")
    assert token["top_logprobs"] == [{"token": "Hi", "logprob": -2.0, "bytes": list(b"Hi")}]


def sse_payloads(events: list[bytes]) -> list[Any]:
    payloads = []
    for event in events:
        assert event.startswith(b"data: ") and event.endswith(b"\n\n")
        payloads.append(json.loads(event[len(b"data: ") : -2]))
    return payloads


def test_streamed_completion_chunks_carry_deltas_then_usage() -> None:
    prepared = completion_request(stream=True, stream_options={"include_usage": True})
    builder = ResponseBuilder(prepared)
    assert builder.opening_events() == []
    events = [e for item in engine_yields() for e in builder.delta_events(0, item)]
    events.append(builder.usage_event())
    chunks = sse_payloads(events)
    texts = [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks[:-1]]
    assert texts == [(0, "He"), (1, "Yo"), (0, "llo"), (1, "")]
    assert chunks[2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_streamed_chat_opens_with_role_and_ends_with_finish_reason() -> None:
    prepared = parse_chat(
        body(messages=[{"role": "user", "content": "x"}], n=2, stream=True), MODEL
    )
    builder = ResponseBuilder(prepared)
    opening = sse_payloads(builder.opening_events())
    assert [c["choices"][0]["delta"] for c in opening] == [{"role": "assistant", "content": ""}] * 2
    chunks = sse_payloads([e for item in engine_yields() for e in builder.delta_events(0, item)])
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    deltas = [(c["choices"][0]["index"], c["choices"][0]["delta"]) for c in chunks]
    assert deltas == [
        (0, {"content": "He"}),
        (1, {"content": "Yo"}),
        (0, {"content": "llo"}),
        (1, {}),
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_batched_prompts_get_distinct_choice_indices() -> None:
    prepared = parse_completion(body(prompt=["a", "b"], n=2), MODEL)
    builder = ResponseBuilder(prepared)
    builder.absorb(1, RequestOutput("r-1", "b", [1], [out(1, "x", [9], "stop")]))
    builder.absorb(0, RequestOutput("r-0", "a", [1, 2], [out(0, "y", [8], "stop")]))
    shape = json.loads(builder.final_body())
    assert [c["text"] for c in shape["choices"]] == ["y", "", "", "x"]
    assert shape["usage"]["prompt_tokens"] == 3


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_prompt_ids_go_with_each_choices_first_chunk_when_one_yield_carries_several(
    kind: str,
) -> None:
    """return_token_ids: an engine yield may carry several deltas of one choice (outputs queued
    while the client was slow); the prompt's ids still go with that choice's first chunk, once."""
    stream = {"stream": True, "return_token_ids": True, "n": 2}
    if kind == "completion":
        prepared = parse_completion(body(prompt="p", **stream), MODEL)
    else:
        prepared = parse_chat(body(messages=[{"role": "user", "content": "x"}], **stream), MODEL)
    builder = ResponseBuilder(prepared)
    prompt_ids = [5, 6, 7]
    yields = [
        RequestOutput("r", "p", prompt_ids, [out(0, "He", [1]), out(0, "llo", [2, 3])]),
        RequestOutput("r", "p", prompt_ids, [out(1, "Yo", [4]), out(0, "!", [9], "stop")]),
        RequestOutput("r", "p", prompt_ids, [out(1, "", [], "length")], finished=True),
    ]
    chunks = sse_payloads([e for item in yields for e in builder.delta_events(0, item)])
    carrying = [
        (c["choices"][0]["index"], c["choices"][0]["token_ids"])
        for c in chunks
        if (c["choices"][0] if kind == "completion" else c).get("prompt_token_ids") == prompt_ids
    ]
    assert carrying == [(0, [1]), (1, [4])]
