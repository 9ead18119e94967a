"""Embeddings through AsyncLLM: one embedding request per prompt, run as every request is
(engine/request/embeddings.py), its vector taken from the finished output."""

from __future__ import annotations

from engine.library.async_llm import AsyncLLM
from engine.messages.params import LoRARequest, PoolingParams
from engine.request.embeddings import embedding_params
from engine.request.outputs import EmbeddingOutput, EmbeddingRequestOutput, EngineError
from engine.request.prompts import Prompt, library_request


async def embed(
    engine: AsyncLLM,
    prompt: Prompt,
    pooling: PoolingParams,
    request_id: str | None = None,
    lora_request: LoRARequest | None = None,
) -> EmbeddingRequestOutput:
    """`prompt`'s embedding (with the LoRA adapter `lora_request`, if any); EngineError as for
    any request (a 400 names what was wrong)."""
    request = library_request(
        prompt, embedding_params(pooling), request_id=request_id, lora_request=lora_request
    )
    final = await engine.complete_request(request)
    vector = next((output.embedding for output in final.outputs if output.embedding), None)
    if vector is None:
        raise EngineError(f"request {final.request_id} ended without its embedding", 500)
    return EmbeddingRequestOutput(
        final.request_id, final.prompt_token_ids, EmbeddingOutput(vector), final.finished
    )
