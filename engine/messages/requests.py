"""Channels gateway -> tokenizer, and tokenizer -> gateway (requests it cannot serve).

The gateway is the only place a request's truth lives (engine/gateway/registry.py), so actors
may restart without losing a request. Each submission carries an epoch; after a restart on the
request path the gateway resubmits every unfinished request under a new epoch with `resume`
naming each unfinished sample and what was already delivered of it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.messages.codec import Channel
from engine.messages.kv_transfer import KvHandoff, KvSource
from engine.messages.params import SamplingParams
from engine.messages.scheduling import AbortRequests, SampleResume


class ChatMessage(msgspec.Struct, array_like=True):
    role: str
    content: str
    # Tool calling: an assistant's calls ({"id", "type", "function": {"name", "arguments"}}),
    # a tool message's call id and function name, as chat templates read them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def template_fields(self) -> dict[str, Any]:
        """The message as a chat template takes it, `content` aside."""
        fields: dict[str, Any] = {"role": self.role}
        if self.tool_calls is not None:
            fields["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            fields["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            fields["name"] = self.name
        return fields


class ChatOptions(msgspec.Struct, array_like=True):
    """How to render a request's messages: a chat template of its own (None: the model's),
    variables for the template (e.g. {"enable_thinking": False}), and whether to open the
    assistant's turn."""

    template: str | None = None
    template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)
    add_generation_prompt: bool = True


class GenerateRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    epoch: int
    params: SamplingParams
    seed: int  # the effective seed: the gateway picks one when the client gave none
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    resume: list[SampleResume] | None = None  # None: a fresh request, every sample from the start
    chat: ChatOptions | None = None  # with messages; None: the model's template, defaults
    kv_handoff: KvHandoff = ""  # P/D: see SubmitRequest
    kv_source: KvSource | None = None


GATEWAY_TO_TOKENIZER: Channel[GenerateRequest | AbortRequests] = Channel(
    "gateway-to-tokenizer", GenerateRequest | AbortRequests
)
