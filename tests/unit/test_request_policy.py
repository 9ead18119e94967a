"""RequestPolicy.apply, the one policy every front end goes through: the model's defaults only
for the fields a client left unset, the chat template's fallback, refusals in the front end's
field names, the prompt forms, and a prefill instance's one token."""

from __future__ import annotations

from typing import Any

import pytest

from engine.messages.params import SamplingParams
from engine.messages.requests import EngineRequest
from engine.request.defaults import SamplingDefaults
from engine.request.outputs import EngineError
from engine.request.policy import RequestPolicy
from engine.request.prompts import Prompt, library_request
from engine.settings.schema import LimitsSettings

DEFAULTS = {"temperature": 0.0, "top_k": 20, "max_tokens": 3}
POLICY = RequestPolicy(
    limits=LimitsSettings(max_n=4),
    max_model_len=256,
    max_queued_samples=8,
    sampling=SamplingDefaults(DEFAULTS),
    chat_template="{{ messages }}",
)


def prepared(
    prompt: Prompt | None,
    params: SamplingParams | None,
    *,
    waiting_samples: int = 0,
    one_token: bool = False,
    defaulted_fields: set[str] | None = None,
    field_names: dict[str, str] | None = None,
    **library: Any,
) -> EngineRequest:
    """The library's request with the policy applied; a front end's unset fields and names."""
    request = library_request(prompt, params, **library)
    if defaulted_fields is not None:
        request.defaulted_fields = frozenset(defaulted_fields)
    request.field_names = field_names or {}
    POLICY.apply(request, waiting_samples=waiting_samples, one_token=one_token)
    return request


def test_defaults_fill_only_the_fields_the_client_left_unset() -> None:
    assert prepared("hi", None).params == SamplingParams(**DEFAULTS)  # type: ignore[arg-type]
    own = SamplingParams(temperature=0.7, max_tokens=9)
    assert prepared("hi", own).params == own  # the library's own params are taken whole
    sent = prepared("hi", own, defaulted_fields={"top_k", "max_tokens"}).params
    assert (sent.temperature, sent.top_k, sent.max_tokens) == (0.7, 20, 3)


def test_prompt_forms_and_the_chat_templates_fallback() -> None:
    assert prepared({"prompt_token_ids": [1, 2]}, None).prompt_token_ids == [1, 2]
    assert prepared({"prompt": "text"}, None).prompt == "text"
    chat = prepared(None, None, messages=[{"role": "user", "content": "x"}])
    assert chat.chat is not None and chat.chat.template == "{{ messages }}"
    own = prepared(None, None, messages=[{"role": "user", "content": "x"}], chat_template="t")
    assert own.chat is not None and own.chat.template == "t"
    assert prepared("hi", None).chat is None
    with pytest.raises(EngineError, match="needs a prompt"):
        prepared(None, None)
    with pytest.raises(EngineError, match="a prompt dict must be"):
        prepared({"text": "x"}, None)


def test_refusals_name_the_front_ends_field_and_keep_the_words() -> None:
    names = {"logprobs": "top_logprobs", "structured_outputs": "guided_json"}
    with pytest.raises(EngineError) as library:
        prepared("hi", SamplingParams(logprobs=21))
    with pytest.raises(EngineError) as api:
        prepared("hi", SamplingParams(logprobs=21), field_names=names)
    assert (library.value.param, api.value.param) == ("logprobs", "top_logprobs")
    assert api.value.message == "top_" + library.value.message
    with pytest.raises(EngineError) as limit:
        prepared("hi", SamplingParams(n=5), field_names=names)
    assert (limit.value.param, limit.value.message) == (
        "n",
        "n has 5 samples, over the limit of 4 (limits.max_n)",
    )


def test_the_queue_and_a_prefill_instances_one_token() -> None:
    with pytest.raises(EngineError) as full:
        prepared("hi", SamplingParams(n=2), waiting_samples=7)
    assert full.value.status == 429
    assert prepared("hi", SamplingParams(max_tokens=50), one_token=True).params.max_tokens == 1
