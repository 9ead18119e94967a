"""A chat completion's answer, read back from the chat path's own output, for the APIs that are
served over it (http/openai/responses/adapter.py, http/anthropic/adapter.py).

Those APIs run their requests as chat requests (one RequestRun: the same policy, limits,
metrics, aborts and actor restarts as /v1/chat/completions) and reshape the answer. What is read
here is JSON this server encoded itself, in this process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from engine.http.openai.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ErrorBody,
    ErrorDetail,
    ToolCallOut,
    Usage,
)

_RESPONSE = msgspec.json.Decoder(ChatCompletionResponse)
_CHUNK = msgspec.json.Decoder(ChatCompletionChunk)
_ERROR = msgspec.json.Decoder(ErrorBody)
_SSE_PREFIX = b"data: "


@dataclass
class ChatResult:
    """The first choice's answer: text, tool calls, why it ended, and the token counts."""

    text: str = ""
    tool_calls: list[ToolCallOut] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def take_usage(self, usage: Usage) -> None:
        self.prompt_tokens = usage.prompt_tokens
        self.completion_tokens = usage.completion_tokens
        details = usage.prompt_tokens_details
        if not isinstance(details, msgspec.UnsetType):
            self.cached_tokens = details.cached_tokens

    def assistant_message(self) -> dict[str, object]:
        """The answer as a chat message, for a later turn of the conversation."""
        message: dict[str, object] = {"role": "assistant", "content": self.text or None}
        if self.tool_calls:
            message["tool_calls"] = [msgspec.to_builtins(call) for call in self.tool_calls]
        return message


@dataclass
class TextDelta:
    text: str


@dataclass
class Finished:
    result: ChatResult


@dataclass
class Failed:
    error: ErrorDetail


ChatStep = TextDelta | Finished | Failed


def read_chat_response(body: bytes) -> ChatResult:
    response = _RESPONSE.decode(body)
    result = ChatResult()
    if response.choices:
        choice = response.choices[0]
        result.text = choice.message.content or ""
        result.tool_calls = list(choice.message.tool_calls or [])
        result.finish_reason = choice.finish_reason
        result.stop_reason = choice.stop_reason
    result.take_usage(response.usage)
    return result


async def chat_steps(events: AsyncIterator[bytes]) -> AsyncIterator[ChatStep]:
    """A chat stream's SSE events → its text as it comes, then the whole answer (or its
    failure). The stream asked for its usage (stream_options.include_usage)."""
    result = ChatResult()
    async for event in events:
        payload = event.removeprefix(_SSE_PREFIX).rstrip(b"\n")
        if payload == b"[DONE]":
            break
        if payload.startswith(b'{"error"'):
            yield Failed(_ERROR.decode(payload).error)
            return
        chunk = _CHUNK.decode(payload)
        if not isinstance(chunk.usage, msgspec.UnsetType):
            result.take_usage(chunk.usage)
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                result.text += delta.content
                yield TextDelta(delta.content)
            for call in delta.tool_calls or []:
                result.tool_calls.append(ToolCallOut(id=call.id, function=call.function))
            if choice.finish_reason is not None:
                result.finish_reason = choice.finish_reason
                result.stop_reason = choice.stop_reason
    yield Finished(result)
