"""RequestPolicy.apply: what every front end's request goes through before the registry sees it.

HTTP, `LLM` and `AsyncLLM` all reach the engine through `AsyncLLM.submit`, which calls `apply`
on the front end's EngineRequest: the model's defaults, the chat template, every range and every
limit are decided here once, so the three refuse and default the same way with the same words.
A front end that names a field otherwise (the chat API's `top_logprobs` for `logprobs`) sets the
request's `field_names`, and the refusal names its field; one that knows which fields its client
left unset (the OpenAI API) sets `defaulted_fields`, and only those take the model's defaults.

Pure: no I/O once loaded, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from engine.messages.params import PoolingParams, SamplingParams
from engine.messages.requests import ChatOptions, EngineRequest
from engine.request.defaults import (
    DEFAULTABLE_FIELDS,
    SamplingDefaults,
    load_chat_template,
    load_sampling_defaults,
)
from engine.request.limits import check_params, check_prompt_size, check_queue
from engine.request.outputs import EngineError
from engine.settings import Settings
from engine.settings.schema import LimitsSettings


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

    def apply(
        self, request: EngineRequest, *, waiting_samples: int = 0, one_token: bool = False
    ) -> None:
        """Give `request` its defaults in place, or raise EngineError (400, 429 for a full
        queue) naming the field as its front end calls it. `waiting_samples`: samples queued
        before their first token. `one_token`: a prefill instance's share of P/D (the prompt
        and one token)."""
        try:
            self._apply(request, waiting_samples, one_token)
        except EngineError as error:
            raise renamed(error, request.field_names) from None

    def _apply(self, request: EngineRequest, waiting_samples: int, one_token: bool) -> None:
        prompt, token_ids = request.prompt, request.prompt_token_ids
        if prompt is None and token_ids is None and request.messages is None:
            raise EngineError(
                "a request needs a prompt, prompt token ids or messages", 400, "prompt"
            )
        params = self.sampling.apply(request.params, request.defaulted_fields)
        if one_token:
            params = msgspec.structs.replace(params, max_tokens=1)
        check_params(params, self.limits, self.max_model_len, self.max_logprobs)
        contents = (message.content for message in request.messages or ())
        check_prompt_size(prompt, token_ids, contents, self.limits, self.max_model_len)
        check_queue(waiting_samples, params.n, self.max_queued_samples)
        request.params = params
        if request.messages is None:
            request.chat = None
        elif request.chat is None:
            request.chat = ChatOptions(self.chat_template)
        elif request.chat.template is None:
            request.chat.template = self.chat_template


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
