"""/v1/embeddings against the shared server through the official `openai` client, judged
against transformers' last_hidden_state (the server's default pooling: the last token's,
normalized)."""

from __future__ import annotations

import openai
import pytest
import torch

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
