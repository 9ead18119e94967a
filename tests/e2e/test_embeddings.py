"""/v1/embeddings against the shared server through the official `openai` client, and rerank and
score (cosines of embeddings, issue 51), judged against transformers' last_hidden_state (the
server's default pooling: the last token's, normalized)."""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.checkpoints import tiny_checkpoint
from tests.e2e.harness import Server
from tests.hf_reference import hf_embedding

PROMPTS = [[5, 17, 42, 8, 99, 3], [7] * 20]


def test_embeddings_match_transformers(client: openai.OpenAI, server: Server) -> None:
    as_floats = client.embeddings.create(model=server.model, input=PROMPTS, encoding_format="float")
    # Without encoding_format the client asks for base64 and decodes the float32 bytes itself.
    as_base64 = client.embeddings.create(model=server.model, input=PROMPTS)
    assert as_floats.usage.prompt_tokens == sum(len(p) for p in PROMPTS)
    for prompt, floats, decoded in zip(PROMPTS, as_floats.data, as_base64.data, strict=True):
        reference = hf_embedding(str(tiny_checkpoint()), prompt, "last", normalize=True)
        torch.testing.assert_close(torch.tensor(floats.embedding), reference, atol=1e-4, rtol=0)
        assert decoded.embedding == pytest.approx(floats.embedding, abs=1e-6)
    text = client.embeddings.create(model=server.model, input="a text input", dimensions=64)
    [item] = text.data
    assert len(item.embedding) == 64 and text.usage.prompt_tokens > 0
    assert abs(sum(v * v for v in item.embedding) - 1.0) < 1e-4


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"input": ""}, "input"), ({"input": [[]]}, "input"), ({"dimensions": 3}, "dimensions")],
)
def test_bad_embedding_requests_are_400s_naming_the_field(
    client: openai.OpenAI, server: Server, fields: dict[str, object], param: str
) -> None:
    body = {"model": server.model, "input": "fine", **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(**body)  # type: ignore[arg-type]
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == param, error
    assert param in error["message"]


QUERY = "where does the lighthouse keeper live"
DOCUMENTS = ["a keeper lives in the lighthouse by the sea", "the cat sat on the mat", "sea"]


def test_rerank_and_score_are_cosines_of_transformers_embeddings(server: Server) -> None:
    """vLLM's score for an embedding model: the cosine of the two texts' pooled embeddings,
    judged against transformers' on the tokens its tokenizer gives each text."""
    checkpoint = str(tiny_checkpoint())
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = {text: tokenizer(text)["input_ids"] for text in [QUERY, *DOCUMENTS]}
    vector = {text: hf_embedding(checkpoint, ids[text], "last", True) for text in ids}
    expected = [float(vector[QUERY] @ vector[document]) for document in DOCUMENTS]
    tokens = sum(len(i) for i in ids.values())  # each text embedded once
    documents: list[object] = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, DOCUMENTS[2]]
    body = {"model": server.model, "query": QUERY, "documents": documents}
    with server.http() as http:
        reranked = http.post("/v1/rerank", json=body | {"top_n": 2}).json()
        cohere = http.post("/v2/rerank", json=body | {"return_documents": False}).json()
        scored = http.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
        pairs = {"text_1": DOCUMENTS[:2], "text_2": [QUERY, DOCUMENTS[0]]}
        paired = http.post("/v1/score", json=pairs).json()
    shown = reranked["results"]
    assert [r["relevance_score"] for r in shown] == sorted(
        (r["relevance_score"] for r in shown), reverse=True
    )
    for result in shown:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-4)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    (left_out,) = set(range(3)) - {r["index"] for r in shown}
    assert expected[left_out] <= shown[-1]["relevance_score"] + 1e-4
    assert reranked["usage"]["total_tokens"] == tokens
    assert sorted(r["index"] for r in cohere["results"]) == [0, 1, 2]
    assert all("document" not in r for r in cohere["results"])
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-4)
    pair_scores = [float(vector[a] @ vector[b]) for a, b in zip(*pairs.values(), strict=True)]
    assert [d["score"] for d in paired["data"]] == pytest.approx(pair_scores, abs=1e-4)


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
        ("/rerank", {"query": "", "documents": ["d"]}, "query"),
        (
            "/v2/rerank",
            {"query": "q", "documents": ["d"], "max_tokens_per_doc": 9},
            "max_tokens_per_doc",
        ),
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
        ("/score", {"text_1": "a", "text_2": ["c", ""]}, "text_2"),
    ],
)
def test_bad_rerank_and_score_requests_are_400s_naming_the_field(
    server: Server, path: str, fields: dict[str, object], param: str
) -> None:
    with server.http() as http:
        reply = http.post(path, json=fields)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param, reply.text
