"""The tokenizer actor: chat template + tokenization, and the first check of a request's size.

Requests come from the gateway; tokenized ones go to the scheduler, refused ones straight back
to the gateway. A request that breaks tokenization fails alone and the actor keeps serving:
status 400 when its input is at fault (a bad value, a chat template that refuses the messages),
500 for anything else. It never imports torch (see hf_tokenizer).
"""

from __future__ import annotations

from typing import Any

import msgspec

from engine.actors.hf_tokenizer import load_tokenizer_without_torch
from engine.actors.runtime.actor import Actor
from engine.messages.requests import (
    GATEWAY_TO_TOKENIZER,
    TOKENIZER_FAILURES,
    GenerateRequest,
    RequestFailed,
)
from engine.messages.scheduling import SCHEDULER_REQUESTS, AbortRequests, SubmitRequest


class TokenizerConfig(msgspec.Struct, frozen=True):
    model_path: str
    max_model_len: int
    vocab_size: int


class PromptTooLong(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class PromptBuilder:
    """Turns a request's prompt, token ids or chat messages into checked prompt token ids."""

    def __init__(self, tokenizer: Any, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def build(self, request: GenerateRequest) -> tuple[str | None, list[int]]:
        """(prompt text, prompt token ids); raises PromptTooLong / ValueError naming the field."""
        prompt = request.prompt
        if request.prompt_token_ids is not None:
            token_ids = request.prompt_token_ids
            self._check_ids(token_ids)
        elif request.messages is not None:
            conversation = [{"role": m.role, "content": m.content} for m in request.messages]
            prompt = self.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=True
            )
            # The template already wrote the special tokens it wants.
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif prompt is not None:
            token_ids = self.tokenizer.encode(prompt)
        else:
            raise ValueError("a request needs a prompt, prompt token ids or messages")
        if not token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        self._check_length(len(token_ids), request)
        return prompt, token_ids

    def _check_ids(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"prompt token id {token_id} is out of range: the vocabulary has "
                    f"{self.vocab_size} tokens (ids 0..{self.vocab_size - 1})"
                )

    def _check_length(self, prompt_len: int, request: GenerateRequest) -> None:
        limit = self.max_model_len
        if prompt_len >= limit:
            raise PromptTooLong(
                f"the prompt has {prompt_len} tokens, but max_model_len is {limit}: "
                f"it must have fewer than {limit} tokens to leave room for output",
                "prompt",
            )
        max_tokens = request.params.max_tokens
        if request.resume is None and max_tokens is not None and prompt_len + max_tokens > limit:
            raise PromptTooLong(
                f"the prompt has {prompt_len} tokens and max_tokens is {max_tokens}: "
                f"{prompt_len + max_tokens} exceeds max_model_len {limit}",
                "max_tokens",
            )


class TokenizerActor(Actor):
    channels = (GATEWAY_TO_TOKENIZER,)

    async def on_start(self) -> dict[str, Any] | None:
        config = msgspec.msgpack.decode(self.config, type=TokenizerConfig)
        tokenizer = load_tokenizer_without_torch(config.model_path)
        self.builder = PromptBuilder(tokenizer, config.max_model_len, config.vocab_size)
        return None

    async def handle(self, ring: str, frames: list[bytes]) -> None:
        to_scheduler: list[bytes] = []
        failures: list[bytes] = []
        for message in GATEWAY_TO_TOKENIZER.decode_many(frames):
            if isinstance(message, AbortRequests):
                to_scheduler.append(SCHEDULER_REQUESTS.encode(message))
                continue
            try:
                _, token_ids = self.builder.build(message)
            except Exception as exc:  # fails this request alone
                failures.append(TOKENIZER_FAILURES.encode(_failure(message, exc)))
                continue
            submit = SubmitRequest(
                request_id=message.request_id,
                epoch=message.epoch,
                prompt_token_ids=token_ids,
                params=message.params,
                seed=message.seed,
                resume=message.resume,
            )
            to_scheduler.append(SCHEDULER_REQUESTS.encode(submit))
        if failures:
            await self.send_many("failures", failures)
        if to_scheduler:
            await self.send_many("submit", to_scheduler)


def _failure(request: GenerateRequest, exc: Exception) -> RequestFailed:
    if isinstance(exc, PromptTooLong):
        status, param, message = 400, exc.param, str(exc)
    elif _input_error(exc):
        status, param, message = 400, _param_of(request), str(exc)
    else:
        status, param = 500, None
        message = f"could not tokenize this request: {type(exc).__name__}: {exc}"
    return RequestFailed(request.request_id, request.epoch, status, message, param)


def _input_error(exc: Exception) -> bool:
    """Errors that say the input is wrong: bad values, and chat templates that refuse the
    messages (jinja2's errors, raised from the template itself)."""
    if isinstance(exc, ValueError | TypeError | LookupError):
        return True
    return any(cls.__module__.startswith("jinja2") for cls in type(exc).__mro__)


def _param_of(request: GenerateRequest) -> str:
    if request.messages is not None:
        return "messages"
    return "prompt"
