"""The server and the library API give the same text for the same request: the HTTP layer adds
nothing and loses nothing (greedy, seeded sampling with n > 1, chat through the template)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from engine import LLM, SamplingParams
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
        model=server.model, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95,
        seed=1234, n=2,
    )  # fmt: skip
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234, n=2)
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
