"""A chat run's answer as the APIs served over the chat path read it (openai/responses/,
anthropic/): its first choice's text as it can be sent (what a chat stream would send as
`content`), then the whole answer: text, tool calls, why it ended and the token counts.

Those APIs run their requests as chat requests (one RequestRun: the same policy, limits,
metrics, aborts and actor restarts as /v1/chat/completions) and reshape the answer. It is read
from the engine's outputs through the chat path's own shaping (bodies.ResponseBuilder and its
ChatAnswer), never from bytes this server wrote.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.http.openai.bodies import ResponseBuilder
from engine.http.openai.chat_output import tool_calls_out
from engine.http.openai.errors import ApiError
from engine.http.openai.protocol import ErrorDetail, ToolCallOut, Usage
from engine.messages.requests import ChatMessage
from engine.request.outputs import RequestOutput


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

    def assistant_message(self) -> ChatMessage:
        """The answer as a chat message, for a later turn of the conversation."""
        calls = [_template_call(call) for call in self.tool_calls]
        return ChatMessage("assistant", self.text, tool_calls=calls or None)


def _template_call(call: ToolCallOut) -> dict[str, Any]:
    """A call as chat templates read it: its arguments as an object (as they were sent, when
    they are no JSON text: an answer cut short)."""
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        arguments = call.function.arguments
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": call.type, "function": function}


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


def chat_result(builder: ResponseBuilder) -> ChatResult:
    """The finished answer of a run whose outputs `builder` absorbed."""
    choice = builder.choices[0]
    content, _, calls = builder.answer(0).final(choice.text)
    result = ChatResult(
        text=content or "",
        tool_calls=tool_calls_out(calls) or [],
        finish_reason="tool_calls" if calls else choice.finish_reason,
        stop_reason=choice.stop_reason,
    )
    result.take_usage(builder.usage())
    return result


class ChatSteps:
    """A streamed chat run as ChatSteps (a Shaper of RequestRun.relay): the first choice's text
    as it can be sent, then Finished with the whole answer, or Failed."""

    def __init__(self, builder: ResponseBuilder) -> None:
        self.builder = builder
        self.result = ChatResult()
        self._failed = False

    def opening(self) -> list[ChatStep]:
        return []

    def shape(self, prompt_index: int, out: RequestOutput) -> list[ChatStep]:
        steps: list[ChatStep] = []
        for choice, _, delta in self.builder.absorb(prompt_index, out):
            if choice.index != 0:
                continue
            finished = delta.finish_reason is not None
            shaped, called = self.builder.answer(0).delta(choice.text, finished)
            if shaped is not None and shaped.content:
                self.result.text += shaped.content
                steps.append(TextDelta(shaped.content))
            if finished:
                self.result.tool_calls = [
                    ToolCallOut(id=call.id, function=call.function)
                    for call in (shaped.tool_calls if shaped is not None else None) or []
                ]
                self.result.finish_reason = "tool_calls" if called else delta.finish_reason
                self.result.stop_reason = delta.stop_reason
        return steps

    def closing(self) -> list[ChatStep]:
        return []

    def failed(self, error: ApiError) -> ChatStep:
        self._failed = True
        return Failed(error.body().error)

    def ending(self) -> list[ChatStep]:
        if self._failed:
            return []
        self.result.take_usage(self.builder.usage())
        return [Finished(self.result)]
