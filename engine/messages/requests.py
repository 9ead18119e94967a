"""Channels gateway -> tokenizer, and tokenizer -> gateway (the ids of the prompts it tokenized).

The gateway is the only place a request's truth lives (engine/inflight/registry.py), so actors
may restart without losing a request. Each submission carries an epoch; after a restart on the
request path the gateway resubmits every unfinished request under a new epoch with `resume`
naming each unfinished sample and what was already delivered of it.

A request given as text (or chat messages) is tokenized by the tokenizer actor, which hands its
ids straight to the gateway (`PromptTokens`), so they cross each ring at most once: the gateway
keeps them for a resubmission (never tokenized again) and for `prompt_token_ids` in outputs.
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


NIL = msgspec.Raw(b"\xc0")  # msgpack's nil: a field left unset


class RoutingView(msgspec.Struct, tag="GenerateRequest", array_like=True):
    """A GenerateRequest frame as the data-parallel router reads it (engine/inflight/router.py),
    field for field: what grows with the input (prompt ids, chat, resume points) stays raw
    msgpack, never built into objects, and the view encodes back to the same frame. The root
    encodes each request once; the router only peeks at it."""

    request_id: str
    epoch: int
    params: SamplingParams
    seed: int
    prompt: str | None = None
    prompt_token_ids: msgspec.Raw = NIL
    messages: msgspec.Raw = NIL
    resume: msgspec.Raw = NIL
    chat: msgspec.Raw = NIL
    kv_handoff: KvHandoff = ""
    kv_source: KvSource | None = None

    def num_prompt_token_ids(self) -> int | None:
        """The prompt's length in tokens, read off its array's header; None: not tokenized."""
        header = memoryview(self.prompt_token_ids)
        first = header[0]
        if first == 0xC0:
            return None
        if 0x90 <= first <= 0x9F:  # fixarray: up to 15 items
            return first & 0x0F
        if first not in (0xDC, 0xDD):
            raise ValueError(f"prompt_token_ids is no msgpack array (first byte {first:#x})")
        width = 2 if first == 0xDC else 4  # array 16, array 32
        return int.from_bytes(header[1 : 1 + width], "big")

    def chat_messages(self) -> list[ChatMessage] | None:
        return msgspec.msgpack.decode(self.messages, type=list[ChatMessage] | None)

    def resumed_samples(self) -> list[SampleResume] | None:
        return msgspec.msgpack.decode(self.resume, type=list[SampleResume] | None)


GATEWAY_TO_TOKENIZER: Channel[GenerateRequest | AbortRequests] = Channel(
    "gateway-to-tokenizer", GenerateRequest | AbortRequests
)
# The router's reading of the same frames (RoutingView: the prompt left undecoded).
ROUTING: Channel[RoutingView | AbortRequests] = Channel(
    "gateway-to-tokenizer (routing)", RoutingView | AbortRequests
)


class PromptTokens(msgspec.Struct, tag=True, array_like=True):
    """The ids the tokenizer made of a request's text prompt (or chat), under this epoch; sent
    once it has passed the request on to the scheduler."""

    request_id: str
    epoch: int
    prompt_token_ids: list[int]


TOKENIZER_TO_GATEWAY: Channel[PromptTokens] = Channel("tokenizer-to-gateway", PromptTokens)
