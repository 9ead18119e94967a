"""Ollama's API (engine/http/ollama/) driven by the official `ollama` client: chat and generate,
streamed and not, answer what the OpenAI API answers for the same request; embeddings are the
OpenAI API's; the catalogue, the loaded models and a model's details read as Ollama's; an empty
request loads a model and keep_alive 0 unloads it; options are refused by the engine's policy
in Ollama's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator

import ollama
import pytest

from tests.e2e.harness import API_KEY, Server

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture
def client(models: Server) -> Iterator[ollama.Client]:
    yield ollama.Client(host=models.url, headers={"Authorization": f"Bearer {API_KEY}"})


def openai_chat(models: Server, model: str, **extra: object) -> dict[str, object]:
    body = {"model": model, "messages": MESSAGES, "temperature": 0, "max_tokens": 8} | extra
    with models.http(timeout=600) as http:
        reply = http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def test_chat_and_generate_answer_as_the_openai_api(models: Server, client: ollama.Client) -> None:
    expected = openai_chat(models, "main")
    content = expected["choices"][0]["message"]["content"]  # type: ignore[index]
    whole = client.chat(model="main", messages=MESSAGES, options=GREEDY)
    assert whole.message.role == "assistant" and whole.message.content == content
    assert whole.done and whole.eval_count == expected["usage"]["completion_tokens"]  # type: ignore[index]
    parts = list(client.chat(model="main", messages=MESSAGES, options=GREEDY, stream=True))
    assert "".join(part.message.content or "" for part in parts) == content
    assert [part.done for part in parts][-1] and not any(part.done for part in parts[:-1])
    assert parts[-1].done_reason == "length"
    # /api/generate renders its prompt as a user turn with the chat template
    generated = client.generate(model="main", prompt=MESSAGES[0]["content"], options=GREEDY)
    assert generated.response == content


def test_format_json_and_a_schema_constrain_the_answer(client: ollama.Client) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    answer = client.chat(model="main", messages=MESSAGES, format=schema, options={"seed": 1})
    assert json.loads(answer.message.content or "") in ({"ok": True}, {"ok": False})
    reply = client.generate(model="main", prompt="hi", format="json", options={"num_predict": 3})
    assert reply.response.startswith("{")  # any JSON object, cut short by num_predict


def test_embeddings_are_the_openai_apis(models: Server, client: ollama.Client) -> None:
    with models.http(timeout=600) as http:
        reply = http.post("/v1/embeddings", json={"model": "main", "input": ["sea", "sky"]})
    expected = [item["embedding"] for item in reply.json()["data"]]
    got = client.embed(model="main", input=["sea", "sky"]).embeddings
    assert [
        list(vector) == pytest.approx(want) for vector, want in zip(got, expected, strict=True)
    ] == [True, True]
    old = client.embeddings(model="main", prompt="sea").embedding
    assert len(old) == len(expected[0])


def test_tags_ps_and_show_describe_the_catalogue(client: ollama.Client) -> None:
    tags = {model.model for model in client.list().models}
    assert tags == {"main", "llama", "llama-q8", "qwen2", "broken"}
    running = {model.model: model for model in client.ps().models}
    assert "main" in running and running["main"].size and running["main"].context_length
    shown = client.show("llama-q8")
    assert shown.details is not None and shown.details.format == "gguf"


def test_an_empty_request_loads_and_keep_alive_0_unloads(client: ollama.Client) -> None:
    loaded = client.generate(model="llama", prompt="")
    assert loaded.done and loaded.done_reason == "load"
    assert "llama" in {model.model for model in client.ps().models}
    unloaded = client.chat(model="llama", messages=[], keep_alive=0)
    assert unloaded.done_reason == "unload"
    assert "llama" not in {model.model for model in client.ps().models}


@pytest.mark.parametrize(
    ("model", "options", "status", "named"),
    [
        ("nowhere", {}, 404, "model 'nowhere' not found"),
        ("main", {"num_predict": 0}, 400, "options.num_predict"),
        ("main", {"mirostat": 2}, 400, "options.mirostat"),
        ("main", {"num_ctx": 1 << 20}, 400, "options.num_ctx"),
    ],
)
def test_a_refusal_is_ollamas_error_naming_the_field(
    client: ollama.Client, model: str, options: dict[str, int], status: int, named: str
) -> None:
    with pytest.raises(ollama.ResponseError) as refused:
        client.chat(model=model, messages=MESSAGES, options=options)
    assert refused.value.status_code == status and named in refused.value.error
