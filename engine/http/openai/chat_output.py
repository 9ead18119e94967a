"""A chat answer's text → what OpenAI's API returns for it: content, `reasoning_content` (with
--reasoning-parser qwen3: the text inside <think>...</think>) and `tool_calls` (per the request's
ToolPlan), whole or as stream deltas.

Streaming: reasoning and plain content go out as they come (holding back only what could be the
start of a tag); an answer that may hold tool calls is held until it is complete, then sent as
one delta with its calls (OpenAI-shaped, each call's arguments whole).
"""

from __future__ import annotations

from engine.http.openai.protocol import (
    ChatDelta,
    FunctionCallOut,
    ToolCallDelta,
    ToolCallOut,
)
from engine.http.openai.tool_calls import ToolCall, ToolPlan

THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content) of a finished answer, as vLLM's qwen3 parser: the reasoning ends at
    </think>; an answer without it has no reasoning."""
    if THINK_END not in text:
        return None, text
    reasoning, _, content = text.partition(THINK_END)
    reasoning = reasoning.split(THINK_START, 1)[-1]
    return reasoning, content.lstrip("\n")


class ChatAnswer:
    """One choice's answer, shaped as it grows."""

    def __init__(self, plan: ToolPlan | None, reasoning: bool) -> None:
        self.plan = plan
        self.reasoning = reasoning
        self._sent_reasoning = 0
        self._sent_content = 0

    def final(self, text: str) -> tuple[str | None, str | None, list[ToolCall]]:
        """(content, reasoning_content, tool calls) of the finished answer."""
        reasoning, content = split_reasoning(text) if self.reasoning else (None, text)
        if self.plan is None:
            return content, reasoning, []
        body, calls = self.plan.read(content)
        return body, reasoning, calls

    def delta(self, text: str, finished: bool) -> tuple[ChatDelta | None, bool]:
        """The delta to send now, given the whole text so far; and whether it made tool calls."""
        if finished:
            content, reasoning, calls = self.final(text)
            delta = ChatDelta(
                reasoning_content=_rest(reasoning, self._sent_reasoning),
                content=_rest(content, self._sent_content),
                tool_calls=[_call_delta(i, call) for i, call in enumerate(calls)] or None,
            )
            return delta, bool(calls)
        reasoning_now, content_now = self._stable(text)
        delta = ChatDelta(
            reasoning_content=_rest(reasoning_now, self._sent_reasoning),
            content=_rest(content_now, self._sent_content),
        )
        self._sent_reasoning = len(reasoning_now or "")
        self._sent_content = len(content_now or "")
        if delta.reasoning_content is None and delta.content is None:
            return None, False
        return delta, False

    def _stable(self, text: str) -> tuple[str | None, str | None]:
        """What of an unfinished answer can be sent for sure: (reasoning, content)."""
        reasoning: str | None = None
        content = text
        if self.reasoning:
            stripped = text.lstrip()
            if THINK_END in text:
                reasoning, content = split_reasoning(text)
            elif stripped.startswith(THINK_START):
                reasoning, content = _held(stripped[len(THINK_START) :], THINK_END), ""
            elif THINK_START.startswith(stripped):
                return None, None  # may yet open a <think>
        if self.plan is not None:  # what may become tool calls is sent once complete
            content = self.plan.streamable(content)
        if self._sent_reasoning and reasoning is None:
            return None, None
        return reasoning, content


def tool_calls_out(calls: list[ToolCall]) -> list[ToolCallOut] | None:
    if not calls:
        return None
    return [
        ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))
        for call in calls
    ]


def _call_delta(index: int, call: ToolCall) -> ToolCallDelta:
    return ToolCallDelta(
        index=index,
        id=call.id,
        function=FunctionCallOut(name=call.name, arguments=call.arguments),
    )


def _held(text: str, tag: str) -> str:
    """`text` less any ending that could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return text[:-size]
    return text


def _rest(text: str | None, sent: int) -> str | None:
    if text is None or len(text) <= sent:
        return None
    return text[sent:]
