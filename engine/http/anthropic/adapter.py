"""Anthropic's Messages API (/v1/messages) over the chat path: a request becomes a chat request
(system and messages with their text, tool_use and tool_result blocks → chat messages, tools,
tool_choice, stop_sequences), and the chat answer becomes a Message (text and tool_use blocks,
stop_reason) or its events (message_start, content_block_start/delta/stop, message_delta,
message_stop). Errors have Anthropic's shape: {"type": "error", "error": {"type", "message"}}.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from typing import Any

import msgspec

from engine.http.anthropic.protocol import (
    ContentBlock,
    CountTokensRequest,
    MessageIn,
    MessagesRequest,
    TextBlock,
    Tool,
    ToolChoice,
)
from engine.http.openai.chat_relay import ChatResult, ChatStep, Failed, TextDelta
from engine.http.openai.decoding import decode_request
from engine.http.openai.errors import ApiError, required
from engine.http.openai.parsing import (
    OpenAIRequest,
    chat_api_request,
    check_model,
    given,
    unset_fields,
)
from engine.http.openai.protocol import (
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCallOut,
    ToolIn,
)
from engine.http.openai.tool_calls import plan_tools, template_kwargs
from engine.messages.params import SamplingParams
from engine.messages.requests import ChatMessage, ChatOptions, EngineRequest

_DECODER = msgspec.json.Decoder(MessagesRequest)
_COUNT_DECODER = msgspec.json.Decoder(CountTokensRequest)
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# An error event in a chat stream (its OpenAI type) → Anthropic's error type.
_STREAM_ERROR_TYPES = {
    "invalid_request_error": "invalid_request_error",
    "rate_limit_error": "rate_limit_error",
}
_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}

EventMaker = Callable[..., bytes]  # an event of this kind with these fields, as SSE


def messages_error_body(status: int, message: str) -> bytes:
    error = {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}
    return msgspec.json.encode({"type": "error", "error": error})


class MessagesAdapter:
    id_prefix = "msg_"

    def __init__(self, body: bytes, served_names: Sequence[str]) -> None:
        req = decode_request(_DECODER, body)
        self.req = req
        self.created = int(time.time())
        self.api = chat_request(req, served_names)
        self.stream = req.stream

    # ------------------------------------------------------------ the Message object

    def final_body(self, api_id: str, result: ChatResult) -> bytes:
        message = self._message(api_id, 0)
        message["content"] = _content_blocks(result)
        message.update(_stop(result))
        message["usage"] = {
            "input_tokens": result.prompt_tokens,
            "output_tokens": result.completion_tokens,
        }
        return msgspec.json.encode(message)

    def _message(self, api_id: str, input_tokens: int) -> dict[str, Any]:
        return {
            "id": api_id,
            "type": "message",
            "role": "assistant",
            "model": self.req.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }

    # ------------------------------------------------------------ the events

    async def events(
        self, api_id: str, input_tokens: int, steps: AsyncIterator[ChatStep]
    ) -> AsyncGenerator[bytes, None]:
        def event(kind: str, **fields: Any) -> bytes:
            payload = msgspec.json.encode({"type": kind, **fields})
            return b"event: %s\ndata: %s\n\n" % (kind.encode(), payload)

        yield event("message_start", message=self._message(api_id, input_tokens))
        text_open = False
        async for step in steps:
            if isinstance(step, Failed):
                kind = _STREAM_ERROR_TYPES.get(step.error.type, "api_error")
                yield event("error", error={"type": kind, "message": step.error.message})
                return
            if isinstance(step, TextDelta):
                if not text_open:
                    text_open = True
                    yield _block_start(event, 0, {"type": "text", "text": ""})
                delta = {"type": "text_delta", "text": step.text}
                yield event("content_block_delta", index=0, delta=delta)
                continue
            for closing in _closing(event, text_open, step.result):
                yield closing


def _closing(event: EventMaker, text_open: bool, result: ChatResult) -> list[bytes]:
    """The events of the finished answer: its text block's end, its tool_use blocks whole,
    why it stopped and the message's end."""
    events = []
    blocks = _content_blocks(result)
    for index, block in enumerate(blocks):
        if block["type"] == "text":
            if not text_open:  # no text came: the (empty or held-back) text block now
                events.append(_block_start(event, index, {"type": "text", "text": ""}))
                if block["text"]:
                    delta = {"type": "text_delta", "text": block["text"]}
                    events.append(event("content_block_delta", index=index, delta=delta))
        else:
            events.append(_block_start(event, index, {**block, "input": {}}))
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
            events.append(event("content_block_delta", index=index, delta=delta))
        events.append(event("content_block_stop", index=index))
    usage = {"output_tokens": result.completion_tokens}
    events.append(event("message_delta", delta=_stop(result), usage=usage))
    events.append(event("message_stop"))
    return events


def _block_start(event: EventMaker, index: int, block: dict[str, Any]) -> bytes:
    return event("content_block_start", index=index, content_block=block)


def _content_blocks(result: ChatResult) -> list[dict[str, Any]]:
    """A text block (when there is text, or nothing else), then a tool_use block per call;
    a call whose arguments are no JSON object (cut short) stays text."""
    uses = []
    text = result.text
    for call in result.tool_calls:
        arguments = _object_or_none(call.function.arguments)
        if arguments is None:
            text += call.function.arguments
        else:
            uses.append(_tool_use(call, arguments))
    blocks = [{"type": "text", "text": text}] if text or not uses else []
    return blocks + uses


def _tool_use(call: ToolCallOut, arguments: dict[str, Any]) -> dict[str, Any]:
    tool_use_id = "toolu_" + call.id.removeprefix("call_")
    return {"type": "tool_use", "id": tool_use_id, "name": call.function.name, "input": arguments}


def _object_or_none(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _stop(result: ChatResult) -> dict[str, Any]:
    """stop_reason and stop_sequence, as vLLM maps a chat finish_reason onto them."""
    if result.tool_calls and any(
        _object_or_none(call.function.arguments) is not None for call in result.tool_calls
    ):
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if result.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if isinstance(result.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": result.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


# ---------------------------------------------------------------- requests → chat requests


def chat_request(req: MessagesRequest, served_names: Sequence[str]) -> OpenAIRequest:
    """The chat run a message is: its messages, sampling and tools."""
    model = check_model(req.model, served_names)
    system = [] if req.system is None else [ChatMessage("system", _text(req.system))]
    messages = [chat for i, m in enumerate(req.messages) for chat in _chat_messages(i, m)]
    if not system and not messages:
        raise ApiError(400, "'messages' must hold at least one message", param="messages")
    tools = [_chat_tool(i, tool) for i, tool in enumerate(req.tools or [])] or None
    choice = req.tool_choice
    parallel = False if choice is not None and choice.disable_parallel_tool_use else None
    chat_choice = None if choice is None else _chat_tool_choice(choice)
    plan, constraint = plan_tools(tools, chat_choice, parallel)
    sampling = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
    params = SamplingParams(
        **given(sampling),
        max_tokens=req.max_tokens,
        stop=list(req.stop_sequences or []),
        structured_outputs=constraint,
    )
    request = EngineRequest(
        params=params,
        messages=[*system, *messages],
        chat=ChatOptions(template_kwargs=template_kwargs(tools)),
        defaulted_fields=unset_fields({**sampling, "max_tokens": req.max_tokens}),
        field_names={"stop": "stop_sequences", "structured_outputs": "tool_choice"},
    )
    return chat_api_request(request, model, stream=req.stream, tool_plan=plan)


def count_tokens_request(body: bytes, served_names: Sequence[str]) -> OpenAIRequest:
    """A /v1/messages/count_tokens body as the chat run whose prompt it counts: the one
    /v1/messages would run for the same system, messages and tools."""
    req = decode_request(_COUNT_DECODER, body)
    fields = {name: getattr(req, name) for name in req.__struct_fields__}
    return chat_request(MessagesRequest(**fields, max_tokens=1), served_names)


def _chat_messages(index: int, message: MessageIn) -> list[ChatMessage]:
    """One message as chat messages: its tool results (tool messages) first, then its text and
    tool calls."""
    where = f"messages[{index}]"
    if message.role not in ("user", "assistant"):
        raise ApiError(
            400,
            f"'{where}.role' must be user or assistant, got {message.role!r}",
            param=f"{where}.role",
        )
    if isinstance(message.content, str):
        return [ChatMessage(message.role, message.content)]
    out: list[ChatMessage] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(message.content):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_use" and message.role == "assistant":
            calls.append(_chat_call(at, block))
        elif block.type == "tool_result" and message.role == "user":
            call_id = required(at, "tool_use_id", block.tool_use_id)
            content = "" if block.content is None else _text(block.content, f"{at}.content")
            out.append(ChatMessage("tool", content, tool_call_id=call_id))
        else:
            raise ApiError(
                400,
                f"'{at}.type' must be text, tool_use (assistant) or tool_result (user), "
                f"got {block.type!r} in a {message.role} message",
                param=f"{at}.type",
            )
    if texts or calls:
        out.append(ChatMessage(message.role, "\n".join(texts), tool_calls=calls or None))
    return out


def _chat_call(at: str, block: ContentBlock) -> dict[str, Any]:
    """A tool_use block as chat templates read a call (its input is the arguments object)."""
    function = {"name": required(at, "name", block.name), "arguments": block.input or {}}
    return {"id": required(at, "id", block.id), "type": "function", "function": function}


def _text(content: str | list[TextBlock], where: str = "system") -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise ApiError(
                400,
                f"'{where}[{j}]' must be a text block ({{'type': 'text', 'text': ...}}), "
                f"got type {block.type!r}",
                param=f"{where}[{j}].type",
            )
        texts.append(block.text)
    return "\n".join(texts)


def _chat_tool(index: int, tool: Tool) -> ToolIn:
    if tool.type not in (None, "custom"):
        raise ApiError(
            400,
            f"'tools[{index}].type' {tool.type!r} is a server tool this server does not have",
            param=f"tools[{index}].type",
        )
    function = FunctionDefinition(
        name=tool.name, description=tool.description, parameters=tool.input_schema
    )
    return ToolIn(function=function)


def _chat_tool_choice(choice: ToolChoice) -> str | NamedToolChoice:
    if choice.type == "tool":
        name = required("tool_choice", "name", choice.name)
        return NamedToolChoice(function=NamedFunction(name=name))
    if choice.type not in _TOOL_CHOICES:
        raise ApiError(
            400,
            f"'tool_choice.type' must be auto, any, tool or none, got {choice.type!r}",
            param="tool_choice.type",
        )
    return _TOOL_CHOICES[choice.type]
