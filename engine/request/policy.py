"""RequestPolicy.prepare: what every front end's request goes through before the gateway sees it.

HTTP, `LLM` and `AsyncLLM` all reach the engine through `AsyncLLM.stream`, which calls
`prepare`: the prompt's form, the model's defaults, every range and every limit are decided here
once, so the three refuse and default the same way with the same words. A front end that names a
field otherwise (the chat API's `top_logprobs` for `logprobs`) passes `field_names`, and the
refusal names its field; one that knows which fields its client left unset (the OpenAI API)
passes `defaulted_fields`, and only those take the model's defaults.

Pure: no I/O once loaded, no torch.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from engine.messages.params import PoolingParams, SamplingParams
from engine.messages.requests import ChatMessage, ChatOptions
from engine.request.defaults import (
    DEFAULTABLE_FIELDS,
    SamplingDefaults,
    load_chat_template,
    load_sampling_defaults,
)
from engine.request.limits import check_params, check_prompt_size, check_queue
from engine.request.outputs import EngineError
from engine.request.prompts import Prompt, chat_messages, split_prompt
from engine.settings import Settings
from engine.settings.schema import LimitsSettings


@dataclass(frozen=True)
class PreparedPrompt:
    """A request the policy accepted, in the gateway's terms."""

    params: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    chat: ChatOptions | None = None


@dataclass(frozen=True)
class RequestPolicy:
    limits: LimitsSettings = field(default_factory=LimitsSettings)
    max_model_len: int = 0
    max_logprobs: int = 20
    max_queued_samples: int = 0
    # What a request gets for the fields it leaves unset (engine/request/defaults.py), and for a
    # chat without a template of its own.
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    chat_template: str | None = None
    pooling: PoolingParams = field(default_factory=PoolingParams)  # embeddings' default

    @classmethod
    def load(cls, settings: Settings, model_path: str, max_model_len: int) -> RequestPolicy:
        """The policy of a started engine; ValueError naming the setting for a bad file."""
        model = settings.model
        defaults = load_sampling_defaults(
            model.generation_config, model_path, model.override_generation_config
        )
        return cls(
            limits=settings.limits,
            max_model_len=max_model_len,
            max_logprobs=model.max_logprobs,
            max_queued_samples=settings.scheduler.max_queued_samples,
            sampling=defaults,
            chat_template=load_chat_template(model.chat_template),
            pooling=PoolingParams.from_config(model.pooler_config),
        )

    def describe_defaults(self) -> str:
        """The sampling defaults and their origin, as the start log and `config show` say."""
        return describe_defaults(self.sampling, self.limits)

    def default_params(self) -> SamplingParams:
        """What a request without SamplingParams samples with (vLLM's LLM does the same)."""
        return self.sampling.apply(SamplingParams(), DEFAULTABLE_FIELDS)

    def prepare(
        self,
        prompt: Prompt | None,
        params: SamplingParams | None,
        *,
        messages: list[Mapping[str, Any]] | None = None,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        defaulted_fields: Collection[str] | None = None,
        field_names: Mapping[str, str] | None = None,
        waiting_samples: int = 0,
        one_token: bool = False,
    ) -> PreparedPrompt:
        """The request with its defaults, or EngineError (400, 429 for a full queue) naming the
        field as the front end calls it.

        `defaulted_fields`: the SamplingParams fields the client left unset (None: every field
        when `params` is None, none otherwise). `waiting_samples`: samples queued before their
        first token. `one_token`: a prefill instance's share of P/D (the prompt and one token)."""
        try:
            return self._prepare(
                prompt,
                self._params(params, defaulted_fields, one_token),
                messages,
                ChatOptions(
                    chat_template or self.chat_template,
                    dict(chat_template_kwargs or {}),
                    add_generation_prompt,
                ),
                waiting_samples,
            )
        except EngineError as error:
            raise renamed(error, field_names or {}) from None

    def _params(
        self, params: SamplingParams | None, defaulted: Collection[str] | None, one_token: bool
    ) -> SamplingParams:
        if params is None:
            params, defaulted = SamplingParams(), DEFAULTABLE_FIELDS
        params = self.sampling.apply(params, defaulted or ())
        return msgspec.structs.replace(params, max_tokens=1) if one_token else params

    def _prepare(
        self,
        prompt: Prompt | None,
        params: SamplingParams,
        messages: list[Mapping[str, Any]] | None,
        chat: ChatOptions,
        waiting_samples: int,
    ) -> PreparedPrompt:
        text, token_ids = split_prompt(prompt)
        chat_in = chat_messages(messages) if messages is not None else None
        if text is None and token_ids is None and chat_in is None:
            raise EngineError(
                "a request needs a prompt, prompt token ids or messages", 400, "prompt"
            )
        check_params(params, self.limits, self.max_model_len, self.max_logprobs)
        contents = (message.content for message in chat_in or ())
        check_prompt_size(text, token_ids, contents, self.limits, self.max_model_len)
        check_queue(waiting_samples, params.n, self.max_queued_samples)
        return PreparedPrompt(
            params, text, token_ids, chat_in, chat if chat_in is not None else None
        )


def describe_defaults(defaults: SamplingDefaults, limits: LimitsSettings) -> str:
    """The defaults in words, with the output bound of a request that sets no max_tokens."""
    text = defaults.describe()
    if "max_tokens" not in defaults.values:
        bound = limits.default_max_tokens
        text += "; max_tokens unset: " + (
            f"{bound} (limits.default_max_tokens)" if bound else "up to max_model_len"
        )
    return text


def renamed(error: EngineError, field_names: Mapping[str, str]) -> EngineError:
    """`error` naming its field as the front end does (the message starts with the field)."""
    name = field_names.get(error.param or "")
    if name is None or error.param is None:
        return error
    message = error.message
    if message.startswith(error.param):
        message = name + message[len(error.param) :]
    return EngineError(message, error.status, name)
