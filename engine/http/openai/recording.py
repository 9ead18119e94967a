"""What one API request adds to the trace (`--record-trace`): collected while it is served,
handed to the trace recorder (engine/trace/recorder.py) as one TraceRecord when it ends.

A request of an API served over the chat path (Responses, Messages) is recorded as the chat
request it ran as (`chat_body`), so that the trace replays it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import msgspec

from engine.http.openai.bodies import ChoiceState
from engine.http.openai.parsing import OpenAIRequest
from engine.messages.requests import ChatMessage, EngineRequest
from engine.trace.format import TRACE_VERSION, Endpoint, RecordedChoice, TraceRecord

# SamplingParams fields that are no chat API field (the run's adapter, pooling).
_NOT_API_FIELDS = ("lora_request", "pooling")


def chat_body(request: EngineRequest, stream: bool) -> bytes:
    """The chat completions body of `request` as its front end built it (before the policy:
    the fields its client left unset stay unset)."""
    fields = msgspec.to_builtins(request.params)
    for name in _NOT_API_FIELDS:
        fields.pop(name, None)
    body = {"messages": [_api_message(m) for m in request.messages or []], **fields}
    body["stream"] = stream
    if request.chat is not None and request.chat.template_kwargs:
        body["chat_template_kwargs"] = request.chat.template_kwargs
    return msgspec.json.encode(body)


def _api_message(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat API takes it: tool call arguments as JSON text."""
    out: dict[str, Any] = {**message.template_fields(), "content": message.content}
    for call in out.get("tool_calls") or []:
        arguments = call["function"]["arguments"]
        if not isinstance(arguments, str):
            call["function"] = {**call["function"], "arguments": json.dumps(arguments)}
    return out


class RequestRecording:
    """What one API request adds to the trace, collected while it is served."""

    __slots__ = ("_arrival", "_body", "_endpoint", "_times", "_tokens")

    def __init__(self, endpoint: str, body: bytes, arrival: float) -> None:
        self._endpoint = endpoint
        self._body = body
        self._arrival = arrival  # Unix time
        # By choice index, made as tokens arrive: a request may be refused for its size.
        self._tokens: dict[int, list[int]] = {}
        self._times: dict[int, list[float]] = {}

    def tokens_delivered(self, choice: int, token_ids: Sequence[int], after: float) -> None:
        """`token_ids` of `choice` left the server `after` seconds from arrival."""
        self._tokens.setdefault(choice, []).extend(token_ids)
        self._times.setdefault(choice, []).extend([round(after, 6)] * len(token_ids))

    def record(
        self,
        api: OpenAIRequest,
        choices: Sequence[ChoiceState],
        *,
        outcome: str,
        status: int,
        prompt_tokens: int,
        completion_tokens: int,
        ttft: float | None,
        e2e: float,
    ) -> TraceRecord:
        endpoint: Endpoint = (
            "chat_completions" if self._endpoint == "chat_completions" else "completions"
        )
        return TraceRecord(
            v=TRACE_VERSION,
            arrival=round(self._arrival, 6),
            endpoint=endpoint,
            body=msgspec.Raw(self._body),
            request_id=api.request_id,
            stream=api.stream,
            n=api.n,
            max_tokens=api.params.max_tokens,
            outcome=outcome,
            status=status,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            ttft=None if ttft is None else round(ttft, 6),
            e2e=round(e2e, 6),
            choices=[
                RecordedChoice(
                    index=c.index,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    token_ids=self._tokens.get(c.index, []),
                    token_times=self._times.get(c.index, []),
                )
                for c in choices
            ],
        )
