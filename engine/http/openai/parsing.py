"""Request bodies → what the engine needs: prompts or messages, `SamplingParams`, output options.

Pure functions, no I/O. The body is decoded once, into the typed request; what is checked here
is the API's own form (prompt shapes, roles, fields that need each other), each bad input an
`ApiError` (400) naming the field. What a request may ask for (ranges, limits) and what it gets
when it leaves a field unset (the model's defaults) is the engine's policy (engine/request/),
the same for the library: the engine's refusal names the API's field (`field_names`).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from engine.http.openai.decoding import decode_request
from engine.http.openai.errors import ApiError
from engine.http.openai.output_controls import output_controls, refuse_unimplemented
from engine.http.openai.protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
)
from engine.http.openai.tool_calls import ToolPlan, plan_tools, template_tools
from engine.messages.params import SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
# The sampling fields a body may leave null, and the model's defaults for each, by API name(s).
_DEFAULTABLE = {
    "temperature": ("temperature",),
    "top_p": ("top_p",),
    "top_k": ("top_k",),
    "min_p": ("min_p",),
    "repetition_penalty": ("repetition_penalty",),
    "repeat_last_n": ("repeat_last_n",),
    "max_tokens": ("max_tokens", "max_completion_tokens"),
}
_OPTIONAL = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repeat_last_n")

_COMPLETION_DECODER = msgspec.json.Decoder(CompletionRequest)
_CHAT_DECODER = msgspec.json.Decoder(ChatCompletionRequest)

Prompt = str | list[int]


@dataclass
class PreparedRequest:
    """One validated API request, ready to hand to the engine."""

    kind: Literal["completion", "chat"]
    request_id: str
    model: str
    created: int
    params: SamplingParams
    prompts: list[Prompt | None]  # completions: one entry per prompt; chat: [None]
    messages: list[Mapping[str, Any]] | None
    stream: bool
    include_usage: bool
    want_logprobs: bool
    return_token_ids: bool = False
    # The client's id (X-Request-Id or the body's request_id): the engine request's id
    client_request_id: str | None = None
    echo: bool = False  # completions: the prompt (and its logprobs) before the completion
    echo_only: bool = False  # max_tokens 0 with echo: the prompt alone, nothing generated
    want_prompt_logprobs: bool = False  # vLLM's prompt_logprobs field in the response
    tool_plan: ToolPlan | None = None  # chat: how the answer becomes tool calls
    chat_template_kwargs: dict[str, Any] | None = None  # chat: variables for the template
    kv_transfer_params: dict[str, Any] | None = None  # P/D across instances
    # For the engine's policy: the sampling fields the body left unset (they take the model's
    # defaults), and the API's name of each field whose name differs from SamplingParams'.
    defaulted_fields: frozenset[str] = frozenset()
    field_names: dict[str, str] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def num_choices(self) -> int:
        """Choices of the response: n per prompt."""
        return self.params.n * len(self.prompts)

    def engine_request_id(self, prompt_index: int) -> str:
        """Each prompt of a batched completions request is its own engine request."""
        base = self.client_request_id or self.request_id
        if len(self.prompts) == 1:
            return base
        return f"{base}-{prompt_index}"


def parse_completion(body: bytes, served_model: str | Sequence[str]) -> PreparedRequest:
    req = decode_request(_COMPLETION_DECODER, body)
    refuse_unimplemented(req)
    model = check_model(req.model, served_model)
    prompts = prompts_of(req.prompt)
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(
            400,
            "'max_tokens' must be >= 1 (0 only scores the prompt, with 'echo': true)",
            param="max_tokens",
        )
    # max_tokens 0 with echo (scoring, as lm-eval's loglikelihood asks): one token is
    # generated, since a request ends with a sampled token, and left out of the response.
    echo_only = req.echo and req.max_tokens == 0
    controls, field_names = output_controls(req)
    # Echoed logprobs cover the prompt's tokens too: ask for theirs with as many alternatives.
    echoed = req.logprobs if req.echo else None
    asked = [k for k in (req.prompt_logprobs, echoed) if k is not None]
    # Without max_tokens, SamplingParams' default: OpenAI's for completions (16).
    length = {} if req.max_tokens is None else {"max_tokens": 1 if echo_only else req.max_tokens}
    params = _sampling_params(
        req,
        **length,
        logprobs=req.logprobs,
        prompt_logprobs=max(asked) if asked else None,
        **controls,
    )
    return PreparedRequest(
        kind="completion",
        request_id="cmpl-" + secrets.token_hex(12),
        model=model,
        created=int(time.time()),
        params=params,
        prompts=list(prompts),
        messages=None,
        stream=req.stream,
        include_usage=_include_usage(req),
        want_logprobs=req.logprobs is not None,
        return_token_ids=req.return_token_ids,
        client_request_id=req.request_id,
        echo=req.echo,
        echo_only=echo_only,
        want_prompt_logprobs=req.prompt_logprobs is not None,
        kv_transfer_params=req.kv_transfer_params,
        defaulted_fields=_defaulted(req),
        field_names=field_names,
    )


def parse_chat(body: bytes, served_model: str | Sequence[str]) -> PreparedRequest:
    req = decode_request(_CHAT_DECODER, body)
    refuse_unimplemented(req)
    model = check_model(req.model, served_model)
    messages = chat_message_dicts(req.messages)
    if not messages:
        raise ApiError(400, "'messages' must hold at least one message", param="messages")
    top = req.top_logprobs
    if top is not None and not req.logprobs:
        raise ApiError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    length_field = "max_completion_tokens" if req.max_completion_tokens is not None else None
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens, length_field = req.max_tokens, "max_tokens"
    tool_plan, tool_constraint = plan_tools(req, parser=None)  # the parser: the server's
    controls, field_names = output_controls(req, tool_constraint)
    field_names |= {"max_tokens": length_field or "max_tokens", "logprobs": "top_logprobs"}
    params = _sampling_params(
        req,
        # OpenAI's chat API: without a limit, a reply may run to the end of the context.
        max_tokens=max_tokens,
        logprobs=(top or 0) if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
        **controls,
    )
    template_kwargs = dict(req.chat_template_kwargs or {})
    tools = template_tools(req)
    if tools is not None:
        template_kwargs["tools"] = tools
    return PreparedRequest(
        kind="chat",
        request_id="chatcmpl-" + secrets.token_hex(12),
        model=model,
        created=int(time.time()),
        params=params,
        prompts=[None],
        messages=messages,
        stream=req.stream,
        include_usage=_include_usage(req),
        want_logprobs=req.logprobs,
        return_token_ids=req.return_token_ids,
        client_request_id=req.request_id,
        want_prompt_logprobs=req.prompt_logprobs is not None,
        tool_plan=tool_plan,
        chat_template_kwargs=template_kwargs or None,
        kv_transfer_params=req.kv_transfer_params,
        defaulted_fields=_defaulted(req),
        field_names=field_names,
    )


def check_model(requested: str | None, served: str | Sequence[str]) -> str:
    """The model name the response shows: the one asked for, any of the served names."""
    names = [served] if isinstance(served, str) else list(served)
    if requested is None:
        return names[0]
    if requested in names:
        return requested
    listed = ", ".join(f"'{name}'" for name in names)
    raise ApiError(
        404, f"model '{requested}' does not exist; this server serves {listed}", param="model"
    )


def prompts_of(prompt: str | list[str | int | list[int]], field: str = "prompt") -> list[Prompt]:
    """Normalise the four OpenAI prompt forms into a list of prompts (text or token ids);
    `field`: the request's name for them ("input" for embeddings), as an error names it."""
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif not prompt:
        raise ApiError(400, f"'{field}' must not be empty", param=field)
    elif all(isinstance(p, int) for p in prompt):
        prompts = [[p for p in prompt if isinstance(p, int)]]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [p for p in prompt if isinstance(p, str)]
    elif all(isinstance(p, list) for p in prompt):
        prompts = [p for p in prompt if isinstance(p, list)]
    else:
        raise ApiError(
            400,
            f"'{field}' must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists, not a mix",
            param=field,
        )
    for i, p in enumerate(prompts):
        where = field if len(prompts) == 1 else f"{field}[{i}]"
        if len(p) == 0:
            raise ApiError(400, f"'{where}' must not be empty", param=where)
    return prompts


def chat_message_dicts(messages: list[ChatMessageIn]) -> list[Mapping[str, Any]]:
    """Checked messages as the chat template takes them (also for /tokenize)."""
    return [_message_dict(i, m) for i, m in enumerate(messages)]


def _message_dict(index: int, message: ChatMessageIn) -> dict[str, Any]:
    where = f"messages[{index}]"
    if message.role not in CHAT_ROLES:
        raise ApiError(
            400,
            f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {message.role!r}",
            param=f"{where}.role",
        )
    role = "system" if message.role == "developer" else message.role
    content = message.content
    if content is None:
        if role != "assistant" and role != "tool":
            raise ApiError(400, f"'{where}.content' is required", param=f"{where}.content")
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        texts = []
        for j, part in enumerate(content):
            if part.type != "text" or part.text is None:
                raise ApiError(
                    400,
                    f"'{where}.content[{j}]' must be a text part "
                    f"({{'type': 'text', 'text': ...}}), got type {part.type!r}",
                    param=f"{where}.content[{j}].type",
                )
            texts.append(part.text)
        text = "\n".join(texts)
    out: dict[str, Any] = {"role": role, "content": text}
    out.update(tool_fields(where, message))
    return out


def tool_fields(where: str, message: ChatMessageIn) -> dict[str, Any]:
    """A message's tool fields as chat templates read them: an assistant's calls (arguments
    as objects, which templates serialize) and a tool message's call id."""
    fields: dict[str, Any] = {}
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            try:
                arguments = json.loads(call.function.arguments)
            except json.JSONDecodeError:
                field = f"{where}.tool_calls[{j}].function.arguments"
                raise ApiError(400, f"'{field}' must be a JSON text", param=field) from None
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": call.type, "function": function})
        fields["tool_calls"] = calls
    if message.tool_call_id is not None:
        fields["tool_call_id"] = message.tool_call_id
    if message.name is not None and message.role == "tool":
        fields["name"] = message.name
    return fields


def _include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _defaulted(req: CompletionRequest | ChatCompletionRequest) -> frozenset[str]:
    """The SamplingParams fields whose API fields the body left unset (or null)."""
    return frozenset(
        name
        for name, api_names in _DEFAULTABLE.items()
        if all(getattr(req, api_name, None) is None for api_name in api_names)
    )


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest, **fields: Any
) -> SamplingParams:
    """SamplingParams of the body's fields (and `fields`); those the body left unset keep
    SamplingParams' defaults, which the engine replaces with the model's where it has some."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sampling = {name: getattr(req, name) for name in _OPTIONAL if getattr(req, name) is not None}
    return SamplingParams(
        **sampling,
        **fields,
        n=req.n,
        min_tokens=req.min_tokens,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        skip_special_tokens=req.skip_special_tokens,
    )
