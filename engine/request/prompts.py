"""The library's front end: its arguments → one EngineRequest. The prompt forms it accepts are
vLLM's: text, token ids, `{"prompt": text}` (TextPrompt) or `{"prompt_token_ids": [...]}`
(TokensPrompt); chat messages are dicts as vLLM's `LLM.chat` takes them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from engine.messages.params import LoRARequest, SamplingParams
from engine.messages.requests import ChatMessage, ChatOptions, EngineRequest
from engine.request.defaults import DEFAULTABLE_FIELDS
from engine.request.outputs import EngineError

Prompt = str | list[int] | Mapping[str, Any]


def library_request(
    prompt: Prompt | None = None,
    params: SamplingParams | None = None,
    *,
    messages: list[Mapping[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    request_id: str | None = None,
    kv_transfer_params: Mapping[str, Any] | None = None,
    trace_headers: Mapping[str, str] | None = None,
    lora_request: LoRARequest | None = None,
) -> EngineRequest:
    """The request `AsyncLLM.stream`'s arguments describe (see there); EngineError (400) naming
    what is wrong with the prompt or the messages. Without `params`, every field the model has
    a default for takes it (vLLM's behaviour); given `params` are taken whole."""
    text, token_ids = split_prompt(prompt)
    defaulted = DEFAULTABLE_FIELDS if params is None else frozenset()
    chat = None
    if messages is not None:
        chat = ChatOptions(chat_template, dict(chat_template_kwargs or {}), add_generation_prompt)
    if lora_request is not None:
        params = msgspec.structs.replace(params or SamplingParams(), lora_request=lora_request)
    return EngineRequest(
        request_id=request_id,
        params=params or SamplingParams(),
        prompt=text,
        prompt_token_ids=token_ids,
        messages=chat_messages(messages) if messages is not None else None,
        chat=chat,
        kv_transfer_params=dict(kv_transfer_params) if kv_transfer_params else None,
        trace_headers=dict(trace_headers) if trace_headers else None,
        defaulted_fields=defaulted,
    )


def split_prompt(prompt: Prompt | None) -> tuple[str | None, list[int] | None]:
    """(text, token ids) of a prompt; EngineError(400) naming what is wrong with it."""
    if prompt is None or isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, Mapping):
        if set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"], None
        if set(prompt) == {"prompt_token_ids"}:
            return None, _token_ids(prompt["prompt_token_ids"])
        raise EngineError(
            "a prompt dict must be {'prompt': text} or {'prompt_token_ids': [ids]}, got keys "
            f"{sorted(map(str, prompt))}",
            400,
            "prompt",
        )
    return None, _token_ids(prompt)


def _token_ids(ids: Any) -> list[int]:
    if isinstance(ids, list | tuple) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in ids
    ):
        return list(ids)
    raise EngineError(
        f"prompt token ids must be a list of integers, got {ids!r:.80}", 400, "prompt"
    )


def chat_messages(messages: list[Mapping[str, Any]]) -> list[ChatMessage]:
    out = []
    for position, message in enumerate(messages):
        role, content = message.get("role"), message.get("content")
        tool_calls = message.get("tool_calls")
        if content is None and tool_calls:
            content = ""  # an assistant turn that only calls tools
        if not isinstance(role, str) or not isinstance(content, str):
            raise EngineError(
                f"messages[{position}] must have a string 'role' and a string 'content'",
                400,
                "messages",
            )
        if tool_calls is not None and not (
            isinstance(tool_calls, list) and all(isinstance(call, dict) for call in tool_calls)
        ):
            raise EngineError(
                f"messages[{position}].tool_calls must be a list of objects", 400, "messages"
            )
        call_id, name = message.get("tool_call_id"), message.get("name")
        out.append(
            ChatMessage(
                role,
                content,
                tool_calls=tool_calls,
                tool_call_id=call_id if isinstance(call_id, str) else None,
                name=name if isinstance(name, str) else None,
            )
        )
    return out
