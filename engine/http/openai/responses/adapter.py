"""OpenAI's Responses API (/v1/responses) over the chat path: a request becomes a chat run
(chat_request.py), and its answer becomes a Response object (message and function_call output
items) or its events (response.created ... response.output_text.delta ... response.completed).

`previous_response_id` continues a stored conversation (store.py): the earlier turns' messages
go before this request's input; `instructions` are not carried over, as in OpenAI's API.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from engine.http.openai.chat_relay import ChatResult, ChatStep, Failed, TextDelta
from engine.http.openai.decoding import decode_request
from engine.http.openai.errors import ApiError
from engine.http.openai.protocol import ToolCallOut
from engine.http.openai.responses.chat_request import chat_request, history, input_messages
from engine.http.openai.responses.protocol import ResponsesRequest, TextConfig
from engine.http.openai.responses.store import Conversation, ResponseStore

_DECODER = msgspec.json.Decoder(ResponsesRequest)
# Why a chat answer ended → the Response's status.
_STATUS = {"length": "incomplete", "abort": "cancelled"}

EventMaker = Callable[..., bytes]  # an event of this kind with these fields, as SSE


class ResponsesAdapter:
    id_prefix = "resp_"

    def __init__(self, body: bytes, served_names: Sequence[str], store: ResponseStore) -> None:
        req = decode_request(_DECODER, body)
        if req.background:
            raise ApiError(400, "'background' responses are not supported", param="background")
        self.req = req
        self.store = store
        self.model = req.model or served_names[0]
        self.created = int(time.time())
        self.conversation: Conversation = [*history(req, store), *input_messages(req.input)]
        self.api = chat_request(req, self.conversation, served_names)
        self.stream = req.stream

    # ------------------------------------------------------------ the Response object

    def final_body(self, api_id: str, result: ChatResult) -> bytes:
        return msgspec.json.encode(self._finished(api_id, result))

    def _finished(self, api_id: str, result: ChatResult) -> dict[str, Any]:
        """The finished Response; a completed one is stored for previous_response_id."""
        status = _STATUS.get(result.finish_reason or "", "completed")
        output = []
        if result.text or not result.tool_calls:
            output.append(_message_item(api_id, result.text, "completed"))
        output += [_function_call_item(call, "completed") for call in result.tool_calls]
        response = self._response(api_id, status, output)
        response["usage"] = {
            "input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": result.prompt_tokens + result.completion_tokens,
        }
        if status == "incomplete":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.req.store and status != "cancelled":
            conversation = [*self.conversation, result.assistant_message()]
            self.store.put(api_id, conversation, response)
        return response

    def _response(self, api_id: str, status: str, output: list[Any]) -> dict[str, Any]:
        req = self.req
        text = req.text or TextConfig()
        return {
            "id": api_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": None,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": msgspec.to_builtins(text.format or {"type": "text"})},
            "tool_choice": msgspec.to_builtins(req.tool_choice or "auto"),
            "tools": msgspec.to_builtins(req.tools or []),
        }

    # ------------------------------------------------------------ the events

    async def events(
        self, api_id: str, input_tokens: int, steps: AsyncIterator[ChatStep]
    ) -> AsyncGenerator[bytes, None]:
        numbers = itertools.count()

        def event(kind: str, **fields: Any) -> bytes:
            payload = {"type": kind, "sequence_number": next(numbers), **fields}
            return b"event: %s\ndata: %s\n\n" % (kind.encode(), msgspec.json.encode(payload))

        opening = self._response(api_id, "in_progress", [])
        yield event("response.created", response=opening)
        yield event("response.in_progress", response=opening)
        place = _text_place(api_id)
        text_open = False
        async for step in steps:
            if isinstance(step, Failed):
                error = step.error
                yield event("error", code=error.code, message=error.message, param=error.param)
                failed = self._response(api_id, "failed", [])
                failed["error"] = {"code": error.code or error.type, "message": error.message}
                yield event("response.failed", response=failed)
                return
            if isinstance(step, TextDelta):
                if not text_open:
                    text_open = True
                    for opened in _text_opening(event, api_id):
                        yield opened
                yield event("response.output_text.delta", **place, delta=step.text, logprobs=[])
                continue
            for closing in self._closing(event, api_id, text_open, step.result):
                yield closing

    def _closing(
        self, event: EventMaker, api_id: str, text_open: bool, result: ChatResult
    ) -> list[bytes]:
        """The events of the finished answer: its text item's end, its function calls whole,
        and the finished Response."""
        events = []
        index = 0
        place = _text_place(api_id)
        if text_open or not result.tool_calls:
            if not text_open:
                events += _text_opening(event, api_id)
            events += [
                event("response.output_text.done", **place, text=result.text, logprobs=[]),
                event("response.content_part.done", **place, part=_text_part(result.text)),
                event(
                    "response.output_item.done",
                    output_index=0,
                    item=_message_item(api_id, result.text, "completed"),
                ),
            ]
            index = 1
        for offset, call in enumerate(result.tool_calls):
            events += _call_events(event, index + offset, call)
        # response.completed also for an incomplete response (its status says so), as vLLM
        # sends it: the openai client's stream helper takes its final response from that event.
        events.append(event("response.completed", response=self._finished(api_id, result)))
        return events


def _text_place(api_id: str) -> dict[str, Any]:
    item_id = "msg_" + api_id.removeprefix(ResponsesAdapter.id_prefix)
    return {"item_id": item_id, "output_index": 0, "content_index": 0}


def _text_opening(event: EventMaker, api_id: str) -> list[bytes]:
    item = _message_item(api_id, None, "in_progress")
    return [
        event("response.output_item.added", output_index=0, item=item),
        event("response.content_part.added", **_text_place(api_id), part=_text_part("")),
    ]


def _call_events(event: EventMaker, index: int, call: ToolCallOut) -> list[bytes]:
    item_id = _function_call_item(call, "completed")["id"]
    opened = {**_function_call_item(call, "in_progress"), "arguments": ""}
    arguments = call.function.arguments
    place = {"item_id": item_id, "output_index": index}
    return [
        event("response.output_item.added", output_index=index, item=opened),
        event("response.function_call_arguments.delta", **place, delta=arguments),
        event("response.function_call_arguments.done", **place, arguments=arguments),
        event(
            "response.output_item.done",
            output_index=index,
            item=_function_call_item(call, "completed"),
        ),
    ]


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(api_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {
        "type": "message",
        "id": _text_place(api_id)["item_id"],
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _function_call_item(call: ToolCallOut, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.function.name,
        "arguments": call.function.arguments,
        "status": status,
    }
