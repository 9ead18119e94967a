"""The server and the library API give the same text for the same request: the HTTP layer adds
nothing and loses nothing (greedy, seeded sampling with n > 1, chat through the template); and
they refuse the same bad request alike (one request policy, engine/request/)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import openai
import pytest

from engine import LLM, SamplingParams
from engine.messages.params import StructuredOutputsParams
from engine.request.outputs import EngineError
from tests.e2e.conftest import MAX_MODEL_LEN
from tests.e2e.harness import Server

PROMPT = "The lighthouse keeper"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell a tale"}]


@pytest.fixture(scope="module")
def llm(model_args: list[str]) -> Iterator[LLM]:
    model = model_args[model_args.index("--model") + 1]
    with LLM(model, max_model_len=MAX_MODEL_LEN, kv_cache_memory=16 * 2**20) as engine:
        yield engine


def test_greedy_completion_equals_the_library_api(
    client: openai.OpenAI, server: Server, llm: LLM
) -> None:
    served = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=24, temperature=0
    )
    (library,) = llm.generate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0))
    assert served.choices[0].text == library.outputs[0].text
    assert served.usage is not None
    assert served.usage.prompt_tokens == len(library.prompt_token_ids)
    assert served.usage.completion_tokens == len(library.outputs[0].token_ids)


def test_seeded_samples_equal_the_library_api(
    client: openai.OpenAI, server: Server, llm: LLM
) -> None:
    served = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        n=2,
    )
    # The fields the request leaves unset take the model's defaults in both (vLLM's idiom).
    params = msgspec.structs.replace(
        llm.get_default_sampling_params(),
        max_tokens=16,
        temperature=0.9,
        top_p=0.95,
        seed=1234,
        n=2,
    )
    (library,) = llm.generate(PROMPT, params)
    by_index = {c.index: c.text for c in served.choices}
    assert by_index == {o.index: o.text for o in library.outputs}
    assert by_index[0] != by_index[1]  # two samples, not one repeated


def test_greedy_chat_equals_the_library_api(
    client: openai.OpenAI, server: Server, llm: LLM
) -> None:
    served = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_completion_tokens=20,
        temperature=0,  # type: ignore[arg-type]
    )
    (library,) = llm.chat(CHAT, SamplingParams(max_tokens=20, temperature=0.0))
    assert served.choices[0].message.content == library.outputs[0].text


# ---- one request policy: the same bad request is refused alike by all three front ends

LONG_PROMPT = "x" * (MAX_MODEL_LEN * 32 + 1)  # more characters than max_model_len could hold
# (what is wrong, the completions body's fields, the same as SamplingParams' fields)
BAD_REQUESTS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("temperature", {"temperature": -1.0}, {"temperature": -1.0}),
    ("top_p", {"top_p": 0.0}, {"top_p": 0.0}),
    ("logprobs", {"logprobs": 21}, {"logprobs": 21}),
    ("prompt_logprobs", {"prompt_logprobs": 21}, {"prompt_logprobs": 21}),
    ("logit_bias", {"logit_bias": {"7": 150.0}}, {"logit_bias": {7: 150.0}}),
    ("stop", {"stop": ["end", ""]}, {"stop": ["end", ""]}),
    ("n", {"n": 129}, {"n": 129}),  # limits.max_n: 128
    ("min_tokens", {"max_tokens": 2, "min_tokens": 3}, {"max_tokens": 2, "min_tokens": 3}),
    (
        "structured_outputs",
        {"structured_outputs": {"choice": []}},
        {"structured_outputs": StructuredOutputsParams(choice=[])},
    ),
]


def library_refusal(call: Callable[..., object], *args: Any, **kwargs: Any) -> EngineError:
    with pytest.raises(EngineError) as refused:
        call(*args, **kwargs)
    return refused.value


def test_http_llm_and_async_llm_refuse_a_bad_request_with_the_same_words(
    server: Server, llm: LLM
) -> None:
    async def first_output(prompt: str, params: SamplingParams) -> object:
        return await anext(aiter(llm.engine.stream(prompt, params)))

    with server.http() as http:
        for field, body, fields in [*BAD_REQUESTS, ("prompt", {}, {})]:
            prompt = LONG_PROMPT if field == "prompt" else PROMPT
            answer = http.post(
                "/v1/completions", json={"model": server.model, "prompt": prompt, **body}
            )
            params = SamplingParams(**fields)
            by_llm = library_refusal(llm.generate, prompt, params, use_tqdm=False)
            # AsyncLLM on the event loop LLM runs it on
            by_async_llm = library_refusal(llm._run, first_output(prompt, params), 60.0)
            error = answer.json()["error"]
            assert (answer.status_code, error["param"]) == (400, field), error
            assert (by_llm.status, by_llm.param) == (by_async_llm.status, by_async_llm.param)
            assert (by_llm.status, by_llm.param) == (400, field)
            assert error["message"] == by_llm.message == by_async_llm.message


def test_the_chat_api_is_refused_in_its_own_field_names_with_the_same_words(
    server: Server, llm: LLM
) -> None:
    with server.http() as http:
        answer = http.post(
            "/v1/chat/completions",
            json={"model": server.model, "messages": CHAT, "logprobs": True, "top_logprobs": 21},
        )
    by_llm = library_refusal(llm.chat, CHAT, SamplingParams(logprobs=21), use_tqdm=False)
    error = answer.json()["error"]
    assert (answer.status_code, error["param"], by_llm.param) == (400, "top_logprobs", "logprobs")
    assert error["message"] == "top_" + by_llm.message
