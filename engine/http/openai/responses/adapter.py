"""OpenAI's Responses API (/v1/responses) over the chat path: a request becomes a chat request
(input items → messages, tools, text.format → response_format, max_output_tokens), and the chat
answer becomes a Response object (message and function_call output items) or its events
(response.created ... response.output_text.delta ... response.completed).

`previous_response_id` continues a stored conversation (store.py): the earlier
turns' messages go before this request's input; `instructions` are not carried over,
as in OpenAI's API.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from engine.http.openai.chat_relay import ChatResult, ChatStep, Failed, TextDelta
from engine.http.openai.decoding import decode_request
from engine.http.openai.errors import ApiError, required
from engine.http.openai.protocol import ToolCallOut
from engine.http.openai.responses.protocol import (
    FunctionTool,
    InputItem,
    NamedFunctionChoice,
    ResponsesRequest,
    TextConfig,
)
from engine.http.openai.responses.store import Conversation, ResponseStore

_DECODER = msgspec.json.Decoder(ResponsesRequest)
_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")
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
        self.conversation: Conversation = [*_history(req, store), *input_messages(req.input)]
        self.chat_body = msgspec.json.encode(self._chat_request())
        self.stream = req.stream
        self.field_names = {"max_tokens": "max_output_tokens"}

    def _chat_request(self) -> dict[str, Any]:
        req = self.req
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat: dict[str, Any] = {
            "model": req.model,
            "messages": [*system, *self.conversation],
            "stream": req.stream,
            "max_completion_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls,
        }
        if req.stream:
            chat["stream_options"] = {"include_usage": True}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
            chat[name] = getattr(req, name)
        if req.tools:
            chat["tools"] = [_chat_tool(i, tool) for i, tool in enumerate(req.tools)]
        if req.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(req.tool_choice)
        if req.text is not None:
            chat["response_format"] = _response_format(req.text)
        return chat

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
            self.store.put(api_id, [*self.conversation, result.assistant_message()])
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


# ---------------------------------------------------------------- requests → chat requests


def _history(req: ResponsesRequest, store: ResponseStore) -> Conversation:
    if req.previous_response_id is None:
        return []
    conversation = store.get(req.previous_response_id)
    if conversation is None:
        raise ApiError(
            404,
            f"previous response with id {req.previous_response_id!r} not found (unknown, not "
            "stored, or dropped from the server's store of finished responses)",
            param="previous_response_id",
            code="not_found",
        )
    return conversation


def input_messages(items: str | list[InputItem]) -> Conversation:
    """`input` as chat messages: consecutive function_call items make one assistant message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if item.type == "message":
            messages.append({"role": _role(where, item), "content": _text(where, item.content)})
        elif item.type == "function_call":
            call = {
                "id": required(where, "call_id", item.call_id),
                "type": "function",
                "function": {
                    "name": required(where, "name", item.name),
                    "arguments": required(where, "arguments", item.arguments),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type == "function_call_output":
            call_id = required(where, "call_id", item.call_id)
            output = required(where, "output", item.output)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise ApiError(
                400,
                f"'{where}.type' must be message, function_call or function_call_output, "
                f"got {item.type!r}",
                param=f"{where}.type",
            )
    return messages


def _role(where: str, item: InputItem) -> str:
    if item.role not in _ROLES:
        raise ApiError(
            400,
            f"'{where}.role' must be one of {', '.join(_ROLES)}, got {item.role!r}",
            param=f"{where}.role",
        )
    return item.role


def _text(where: str, content: str | list[Any] | None) -> str:
    if content is None:
        raise ApiError(400, f"'{where}.content' is required", param=f"{where}.content")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise ApiError(
                400,
                f"'{where}.content[{j}]' must be a text part ({{'type': 'input_text', "
                f"'text': ...}}), got type {part.type!r}",
                param=f"{where}.content[{j}].type",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _chat_tool(index: int, tool: FunctionTool) -> dict[str, Any]:
    where = f"tools[{index}]"
    if tool.type != "function":
        raise ApiError(
            400,
            f"'{where}.type' must be 'function' (this server has no built-in tools), "
            f"got {tool.type!r}",
            param=f"{where}.type",
        )
    function: dict[str, Any] = {"name": required(where, "name", tool.name)}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters or {"type": "object"}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | NamedFunctionChoice) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.type != "function" or choice.name is None:
        raise ApiError(
            400,
            "'tool_choice' must be none, auto, required or {'type': 'function', 'name': ...}",
            param="tool_choice",
        )
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(text: TextConfig) -> dict[str, Any] | None:
    fmt = text.format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        schema = {"name": fmt.name, "schema": fmt.schema, "strict": fmt.strict}
        return {"type": "json_schema", "json_schema": schema}
    raise ApiError(
        400,
        f"'text.format.type' must be text, json_object or json_schema, got {fmt.type!r}",
        param="text.format.type",
    )
