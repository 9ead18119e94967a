"""Request bodies → what the engine needs: prompts or messages, `SamplingParams`, output options.

Pure functions, no I/O: every bad input raises `ApiError` (400) naming the field, so the whole
input contract is testable without a server.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from engine.http.decoding import decode_request
from engine.http.errors import ApiError
from engine.http.output_controls import output_controls, refuse_unimplemented
from engine.http.protocol import ChatCompletionRequest, ChatMessageIn, CompletionRequest
from engine.http.tool_calls import ToolPlan, plan_tools, template_tools
from engine.messages.params import SamplingParams

CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_TOP_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

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
    refuse_unimplemented(body)
    model = _check_model(req.model, served_model)
    prompts = _prompts_of(req.prompt)
    if req.max_tokens == 0 and not req.echo:
        raise ApiError(
            400,
            "'max_tokens' must be >= 1 (0 only scores the prompt, with 'echo': true)",
            param="max_tokens",
        )
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400,
            f"'logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}",
            param="logprobs",
        )
    # max_tokens 0 with echo (scoring, as lm-eval's loglikelihood asks): one token is
    # generated, since a request ends with a sampled token, and left out of the response.
    echo_only = req.echo and req.max_tokens == 0
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
    params = _sampling_params(req, max_tokens=1 if echo_only else max_tokens, logprobs=req.logprobs)
    params = msgspec.structs.replace(params, **output_controls(req))
    # Echoed logprobs cover the prompt's tokens too: ask for theirs with as many alternatives.
    echoed = req.logprobs if req.echo else None
    asked = [k for k in (req.prompt_logprobs, echoed) if k is not None]
    params.prompt_logprobs = max(asked) if asked else None
    _validate(params, renames={})
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
    )


def parse_chat(body: bytes, served_model: str | Sequence[str]) -> PreparedRequest:
    req = decode_request(_CHAT_DECODER, body)
    refuse_unimplemented(body)
    model = _check_model(req.model, served_model)
    messages = chat_message_dicts(req.messages)
    if not messages:
        raise ApiError(400, "'messages' must hold at least one message", param="messages")
    top = req.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(
            400,
            f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top}",
            param="top_logprobs",
        )
    if top is not None and not req.logprobs:
        raise ApiError(400, "'top_logprobs' requires 'logprobs': true", param="top_logprobs")
    length_field = "max_completion_tokens" if req.max_completion_tokens is not None else None
    max_tokens = req.max_completion_tokens
    if max_tokens is None:
        max_tokens, length_field = req.max_tokens, "max_tokens"
    logprobs = (top or 0) if req.logprobs else None
    params = _sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
    params.prompt_logprobs = req.prompt_logprobs
    tool_plan, tool_constraint = plan_tools(req, parser=None)  # the parser: the server's
    params = msgspec.structs.replace(params, **output_controls(req, tool_constraint))
    _validate(
        params, renames={"max_tokens": length_field or "max_tokens", "logprobs": "top_logprobs"}
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
    )


def _check_model(requested: str | None, served: str | Sequence[str]) -> str:
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


def _prompts_of(prompt: str | list[str | int | list[int]]) -> list[Prompt]:
    """Normalise the four OpenAI prompt forms into a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif not prompt:
        raise ApiError(400, "'prompt' must not be empty", param="prompt")
    elif all(isinstance(p, int) for p in prompt):
        prompts = [[p for p in prompt if isinstance(p, int)]]
    elif all(isinstance(p, str) for p in prompt):
        prompts = [p for p in prompt if isinstance(p, str)]
    elif all(isinstance(p, list) for p in prompt):
        prompts = [p for p in prompt if isinstance(p, list)]
    else:
        raise ApiError(
            400,
            "'prompt' must be a string, a list of strings, a list of token ids or a list of "
            "token-id lists, not a mix",
            param="prompt",
        )
    for i, p in enumerate(prompts):
        where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
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


def _sampling_params(
    req: CompletionRequest | ChatCompletionRequest, *, max_tokens: int | None, logprobs: int | None
) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    return SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
    )


def _validate(params: SamplingParams, renames: dict[str, str]) -> None:
    """Range checks live on SamplingParams; report them under the API's field name."""
    try:
        params.validate()
    except ValueError as e:
        message = str(e)
        field = message.split(" ", 1)[0]
        api_field = renames.get(field, field)
        if api_field != field:
            message = api_field + message[len(field) :]
        raise ApiError(
            400, f"invalid value for '{api_field}': {message}", param=api_field
        ) from None
    for i, stop in enumerate(params.stop):
        if not stop:
            raise ApiError(400, f"'stop[{i}]' must not be empty", param="stop")
