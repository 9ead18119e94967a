"""The Responses and Messages adapters' shaping of a chat answer: the cases the e2e tests
(tests/e2e/test_responses_and_messages_api.py) cannot make a random model produce at will."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from engine.http.anthropic.adapter import MessagesAdapter
from engine.http.openai.chat_relay import ChatResult, ChatStep, Failed, Finished, TextDelta
from engine.http.openai.protocol import ErrorDetail, FunctionCallOut, ToolCallOut
from engine.http.openai.responses.adapter import ResponsesAdapter
from engine.http.openai.responses.store import ResponseStore
from engine.messages.requests import ChatMessage


async def replay(steps: list[ChatStep]) -> AsyncIterator[ChatStep]:
    for step in steps:
        yield step


def events_of(adapter: Any, steps: list[ChatStep]) -> list[tuple[str, dict[str, Any]]]:
    async def collect() -> list[bytes]:
        return [e async for e in adapter.events("x_1", 7, replay(steps))]

    out = []
    for raw in asyncio.run(collect()):
        head, data = raw.decode().strip().split("\n")
        out.append((head.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def messages_adapter() -> MessagesAdapter:
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    return MessagesAdapter(json.dumps(body).encode(), ["m"])


def test_a_matched_stop_string_is_anthropics_stop_sequence() -> None:
    result = ChatResult(text="ab", finish_reason="stop", stop_reason="END", completion_tokens=2)
    message = json.loads(messages_adapter().final_body("msg_1", result))
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", "END")
    eos = ChatResult(text="ab", finish_reason="stop", stop_reason=None)
    assert json.loads(messages_adapter().final_body("msg_1", eos))["stop_reason"] == "end_turn"


def test_a_tool_call_cut_short_stays_text_in_a_message() -> None:
    cut = ToolCallOut(id="call_1", function=FunctionCallOut(name="f", arguments='{"a": '))
    result = ChatResult(tool_calls=[cut], finish_reason="length")
    message = json.loads(messages_adapter().final_body("msg_1", result))
    assert message["content"] == [{"type": "text", "text": '{"a": '}]
    assert message["stop_reason"] == "max_tokens"


def test_a_messages_stream_that_fails_ends_with_anthropics_error_event() -> None:
    error = ErrorDetail(message="boom", type="server_error", param=None, code=None)
    events = events_of(messages_adapter(), [TextDelta("a"), Failed(error)])
    assert [kind for kind, _ in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error", "message": "boom"}}


def test_a_responses_stream_that_fails_ends_with_error_and_response_failed() -> None:
    store = ResponseStore(4)
    adapter = ResponsesAdapter(b'{"input": "hi"}', ["m"], store)
    error = ErrorDetail(message="boom", type="server_error", param=None, code=None)
    events = events_of(adapter, [TextDelta("a"), Failed(error)])
    kinds = [kind for kind, _ in events]
    assert kinds[-2:] == ["error", "response.failed"]
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    assert events[-1][1]["response"]["error"]["message"] == "boom"
    assert len(store) == 0  # a failed response is not kept for previous_response_id


def test_a_finished_responses_stream_is_stored_with_its_answer() -> None:
    store = ResponseStore(4)
    adapter = ResponsesAdapter(b'{"input": "hi", "instructions": "brief"}', ["m"], store)
    result = ChatResult(text="yo", finish_reason="length", prompt_tokens=3, completion_tokens=1)
    events = events_of(adapter, [TextDelta("yo"), Finished(result)])
    final = events[-1][1]["response"]
    assert events[-1][0] == "response.completed" and final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    # The instructions are not part of the stored conversation, as in OpenAI's API.
    assert store.get("x_1") == [ChatMessage("user", "hi"), ChatMessage("assistant", "yo")]
    assert store.response("x_1") == final  # what GET /v1/responses/{id} answers
    assert store.delete("x_1") and store.response("x_1") is None and not store.delete("x_1")
