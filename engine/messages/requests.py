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
from engine.messages.scheduling import AbortRequests, SampleResume, TenantTag


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


class EngineRequest(msgspec.Struct, array_like=True, kw_only=True):
    """One request as its front end builds it, once: the OpenAI, Anthropic and Responses
    adapters from their bodies, `LLM` and `AsyncLLM` from their arguments. `AsyncLLM.submit`
    applies the request policy to it in place (engine/request/policy.py: the model's defaults,
    the chat template, every limit, the KV directives of `kv_transfer_params`), the registry of
    requests in flight keeps it as the request's truth (engine/inflight/records.py), and every
    submission to the tokenizer carries it (GenerateRequest).

    The prompt is text, token ids or chat messages (with `chat`: how to render them). The last
    fields are the front end's, read in the root only: the W3C trace context its span continues,
    the sampling fields its client left unset (they take the model's defaults; the others are
    taken as given), and its name of each field whose name differs from SamplingParams', for
    refusals; `submit` empties the last two once the policy has read them."""

    request_id: str | None = None  # the client's; None: the registry gives one
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # given, or learnt from the tokenizer
    messages: list[ChatMessage] | None = None
    chat: ChatOptions | None = None  # with messages; None: the model's template, defaults
    kv_handoff: KvHandoff = ""  # P/D: see SubmitRequest
    kv_source: KvSource | None = None
    kv_transfer_params: dict[str, Any] | None = None  # P/D across instances, as the client sent
    trace_headers: dict[str, str] | None = None
    defaulted_fields: frozenset[str] = frozenset()
    field_names: dict[str, str] = msgspec.field(default_factory=dict)
    # /tokenize: the tokenizer only sends the prompt's ids back (PromptTokens), the model never
    # sees it; chats are rendered where any chat is, in the tokenizer actor, within its bounds.
    tokenize_only: bool = False
    # Whom it runs for, and how (engine/tenants/): set by the server from the API key (None:
    # the one tenant of a server without a tenants file); vLLM's `priority` (lower runs first,
    # bounded by the tenant's ceiling) and `cache_salt`. The scheduler reads them (SubmitRequest).
    tenant: TenantTag | None = None
    priority: int = 0
    cache_salt: str | None = None


class GenerateRequest(msgspec.Struct, tag=True, array_like=True):
    """A request as submitted under an epoch: the request itself, the seed the registry gave
    it, and, for a resubmission, what each unfinished sample has already delivered."""

    request: EngineRequest
    epoch: int
    seed: int  # the effective seed: the registry picks one when the client gave none
    resume: list[SampleResume] | None = None  # None: a fresh request, every sample from the start

    @property
    def request_id(self) -> str:
        return self.request.request_id or ""

    @property
    def params(self) -> SamplingParams:
        return self.request.params


NIL = msgspec.Raw(b"\xc0")  # msgpack's nil: a field left unset


class RoutedRequest(msgspec.Struct, array_like=True, kw_only=True):
    """An EngineRequest as the data-parallel router reads it, field for field: what grows with
    the input (prompt ids, chat, the front end's fields) stays raw msgpack."""

    request_id: str | None = None
    params: SamplingParams = msgspec.field(default_factory=SamplingParams)
    prompt: str | None = None
    prompt_token_ids: msgspec.Raw = NIL
    messages: msgspec.Raw = NIL
    chat: msgspec.Raw = NIL
    kv_handoff: KvHandoff = ""
    kv_source: KvSource | None = None
    kv_transfer_params: msgspec.Raw = NIL
    trace_headers: msgspec.Raw = NIL
    defaulted_fields: msgspec.Raw = msgspec.Raw(b"\x90")  # an empty array
    field_names: msgspec.Raw = msgspec.Raw(b"\x80")  # an empty map
    tokenize_only: bool = False
    tenant: msgspec.Raw = NIL
    priority: int = 0
    cache_salt: msgspec.Raw = NIL


class RoutingView(msgspec.Struct, tag="GenerateRequest", array_like=True):
    """A GenerateRequest frame as the data-parallel router reads it (engine/inflight/router.py):
    what grows with the input stays raw msgpack, never built into objects, and the view encodes
    back to the same frame. The root encodes each request once; the router only peeks at it."""

    request: RoutedRequest
    epoch: int
    seed: int
    resume: msgspec.Raw = NIL

    @property
    def request_id(self) -> str:
        return self.request.request_id or ""

    def num_prompt_token_ids(self) -> int | None:
        """The prompt's length in tokens, read off its array's header; None: not tokenized."""
        header = memoryview(self.request.prompt_token_ids)
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
        return msgspec.msgpack.decode(self.request.messages, type=list[ChatMessage] | None)

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
