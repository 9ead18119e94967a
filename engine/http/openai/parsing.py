"""Request bodies → what the engine needs: one EngineRequest per prompt (chat: one), and how
the answer is to be shaped (`OpenAIRequest`).

Pure functions, no I/O. The body is decoded once, into the typed request; what is checked here
is the API's own form (prompt shapes, roles, fields that need each other), each bad input an
`ApiError` (400) naming the field. What a request may ask for (ranges, limits) and what it gets
when it leaves a field unset (the model's defaults) is the engine's policy (engine/request/),
the same for the library: the engine's refusal names the API's field (`field_names`).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from engine.http.openai.chat_messages import chat_messages
from engine.http.openai.decoding import decode_request
from engine.http.openai.errors import ApiError
from engine.http.openai.output_controls import output_controls, refuse_unimplemented
from engine.http.openai.protocol import ChatCompletionRequest, CompletionRequest
from engine.http.openai.tool_calls import ToolPlan, plan_tools, template_kwargs
from engine.messages.params import SamplingParams
from engine.messages.requests import ChatOptions, EngineRequest

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
class OpenAIRequest:
    """One API request: its engine requests (completions: one per prompt; the other APIs: one),
    and what shaping the answer needs."""

    kind: Literal["completion", "chat"]
    request_id: str  # the response's id: cmpl-..., chatcmpl-...
    model: str
    created: int
    requests: list[EngineRequest]
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
    kv_transfer_asked: bool = False  # P/D: the answer carries kv_transfer_params
    priority: int | None = None  # vLLM's; None: the tenant's default
    cache_salt: str | None = None  # vLLM's

    @property
    def params(self) -> SamplingParams:
        """The sampling parameters, the same for every prompt."""
        return self.requests[0].params

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def num_choices(self) -> int:
        """Choices of the response: n per prompt."""
        return self.n * len(self.requests)

    @property
    def most_tokens(self) -> int:
        """What it may cost, held against its tenant's tokens_per_minute while it runs: its
        prompts' tokens when given as ids (text is tokenized later), every sample's max_tokens."""
        prompt_ids = sum(len(request.prompt_token_ids or ()) for request in self.requests)
        return prompt_ids + self.num_choices * (self.params.max_tokens or 0)

    def name_engine_requests(self) -> None:
        """Each prompt of a batched completions request is its own engine request, named after
        the client's id (or the response's)."""
        base = self.client_request_id or self.request_id
        for i, request in enumerate(self.requests):
            request.request_id = base if len(self.requests) == 1 else f"{base}-{i}"


def parse_completion(body: bytes, served_model: str | Sequence[str]) -> OpenAIRequest:
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
    requests = [
        EngineRequest(
            params=params,
            prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=None if isinstance(prompt, str) else prompt,
            kv_transfer_params=req.kv_transfer_params,
            defaulted_fields=_defaulted(req),
            field_names=field_names,
        )
        for prompt in prompts
    ]
    return OpenAIRequest(
        kind="completion",
        request_id="cmpl-" + secrets.token_hex(12),
        model=model,
        created=int(time.time()),
        requests=requests,
        stream=req.stream,
        include_usage=_include_usage(req),
        want_logprobs=req.logprobs is not None,
        return_token_ids=req.return_token_ids,
        client_request_id=req.request_id,
        priority=req.priority,
        cache_salt=req.cache_salt,
        echo=req.echo,
        echo_only=echo_only,
        want_prompt_logprobs=req.prompt_logprobs is not None,
        kv_transfer_asked=req.kv_transfer_params is not None,
    )


def parse_chat(body: bytes, served_model: str | Sequence[str]) -> OpenAIRequest:
    req = decode_request(_CHAT_DECODER, body)
    refuse_unimplemented(req)
    model = check_model(req.model, served_model)
    messages = chat_messages(req.messages)
    if not messages:
        raise ApiError(400, "'messages' must hold at least one message", param="messages")
    top = req.top_logprobs
    if top is not None and not req.logprobs:
        raise ApiError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    length_field = "max_completion_tokens" if req.max_completion_tokens is not None else None
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens, length_field = req.max_tokens, "max_tokens"
    # the parser: the server's
    tool_plan, tool_constraint = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
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
    request = EngineRequest(
        params=params,
        messages=messages,
        chat=ChatOptions(
            template_kwargs={**(req.chat_template_kwargs or {}), **template_kwargs(req.tools)}
        ),
        kv_transfer_params=req.kv_transfer_params,
        defaulted_fields=_defaulted(req),
        field_names=field_names,
    )
    return OpenAIRequest(
        kind="chat",
        request_id="chatcmpl-" + secrets.token_hex(12),
        model=model,
        created=int(time.time()),
        requests=[request],
        stream=req.stream,
        include_usage=_include_usage(req),
        want_logprobs=req.logprobs,
        return_token_ids=req.return_token_ids,
        client_request_id=req.request_id,
        priority=req.priority,
        cache_salt=req.cache_salt,
        want_prompt_logprobs=req.prompt_logprobs is not None,
        tool_plan=tool_plan,
        kv_transfer_asked=req.kv_transfer_params is not None,
    )


def chat_api_request(
    request: EngineRequest, model: str, *, stream: bool, tool_plan: ToolPlan | None
) -> OpenAIRequest:
    """The chat run of a request of an API served over the chat path (the Responses and
    Messages APIs), built by its adapter."""
    return OpenAIRequest(
        kind="chat",
        request_id="chatcmpl-" + secrets.token_hex(12),
        model=model,
        created=int(time.time()),
        requests=[request],
        stream=stream,
        include_usage=True,
        want_logprobs=False,
        tool_plan=tool_plan,
    )


def given(fields: Mapping[str, Any]) -> dict[str, Any]:
    """The fields that have a value (the others keep SamplingParams' defaults)."""
    return {name: value for name, value in fields.items() if value is not None}


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


def _include_usage(req: CompletionRequest | ChatCompletionRequest) -> bool:
    return req.stream_options is not None and req.stream_options.include_usage


def _defaulted(req: CompletionRequest | ChatCompletionRequest) -> frozenset[str]:
    """The SamplingParams fields whose API fields the body left unset (or null)."""
    return unset_fields(
        {name: getattr(req, name, None) for names in _DEFAULTABLE.values() for name in names}
    )


def unset_fields(api_fields: Mapping[str, Any]) -> frozenset[str]:
    """The defaultable SamplingParams fields none of whose API fields in `api_fields` (API name
    → the body's value) has a value: they take the model's defaults."""
    return frozenset(
        name
        for name, api_names in _DEFAULTABLE.items()
        if all(api_fields.get(api_name) is None for api_name in api_names)
    )


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest, **fields: Any
) -> SamplingParams:
    """SamplingParams of the body's fields (and `fields`); those the body left unset keep
    SamplingParams' defaults, which the engine replaces with the model's where it has some."""
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sampling = given({name: getattr(req, name) for name in _OPTIONAL})
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
