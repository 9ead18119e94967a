"""POST /v1/embeddings (OpenAI's Embeddings API, as vLLM serves it for a decoder model): each
input is one embedding request run through the engine as any request is
(engine/library/embeddings.py), so it is batched with generation traffic and resumed after actor
restarts.

`input` takes OpenAI's four forms (a string, strings, token ids, token-id lists); the vector is
pooled as model.pooler_config says (vLLM's default: the last token's, normalized), and
`normalize` (vLLM's extra field) may turn normalization off. `encoding_format` base64 sends the
little-endian float32 bytes, as OpenAI does. `dimensions` may only name the model's own size:
this engine does not truncate vectors (no Matryoshka models).
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Sequence
from typing import Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.http.guards import until_disconnect
from engine.http.openai.decoding import decode_request
from engine.http.openai.errors import ApiError, outcome_of
from engine.http.openai.parsing import check_model, prompts_of
from engine.http.openai.protocol import Count, TokenId
from engine.http.state import ServerState
from engine.library.embeddings import embed
from engine.messages.vectors import float32_bytes
from engine.request.embeddings import pooling_for
from engine.request.outputs import EmbeddingRequestOutput, EngineError
from engine.request.prompts import Prompt

JSON = "application/json"
ENDPOINT = "embeddings"


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: msgspec allows one array type per union,
    # so elements are typed here and their mix is checked in `prompts_of`.
    input: str | list[str | TokenId | list[TokenId]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Count | None = None
    user: str | None = None
    normalize: bool | None = None  # vLLM's: None = as model.pooler_config says


class EmbeddingData(msgspec.Struct, kw_only=True):
    index: int
    embedding: list[float] | str  # str: base64 of little-endian float32
    object: str = "embedding"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    id: str
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: str = "list"
    created: int = 0


_DECODER = msgspec.json.Decoder(EmbeddingRequest)


def embedding_routes(state: ServerState) -> list[Route]:
    async def embeddings(request: Request) -> Response:
        try:
            return await _serve(request, state)
        except ApiError as e:
            state.metrics.count_request(ENDPOINT, outcome_of(e.status))
            raise

    return [Route("/v1/embeddings", embeddings, methods=["POST"])]


async def _serve(request: Request, state: ServerState) -> Response:
    if state.draining:
        raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
    state.authorize(request)
    body = await state.read_body(request)
    req = decode_request(_DECODER, body)
    model = check_model(req.model, state.served_names)
    inputs = prompts_of(req.input, "input")
    metrics = state.metrics.for_model(state.base_of(model))
    outputs = await until_disconnect(request, embed_all(state, model, inputs, req.normalize))
    if outputs is None:  # the client left; gather's cancellation aborted its requests
        metrics.count_request(ENDPOINT, "aborted")
        return Response(status_code=499)
    _check_dimensions(req.dimensions, outputs)
    metrics.count_request(ENDPOINT, "success")
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    metrics.add_prompt_tokens(prompt_tokens)
    response = EmbeddingResponse(
        id=f"embd-{time.time_ns():x}",
        data=[
            EmbeddingData(index=index, embedding=_encoded(output, req.encoding_format))
            for index, output in enumerate(outputs)
        ],
        model=model,
        usage=EmbeddingUsage(prompt_tokens=prompt_tokens, total_tokens=prompt_tokens),
        created=int(time.time()),
    )
    return Response(msgspec.json.encode(response), media_type=JSON)


async def embed_all(
    state: ServerState,
    model: str,
    inputs: Sequence[Prompt],
    normalize: bool | None = None,
    keep_alive: float | None = None,
    field: str = "input",
) -> list[EmbeddingRequestOutput]:
    """One embedding per input, on the model `model` names (loaded if need be); EngineError
    as ApiError (a refused input names `field`, the request's name for the inputs)."""
    try:
        lease = await state.acquire(model, keep_alive)
    except EngineError as e:
        raise ApiError(e.status, e.message, param="model" if e.status == 404 else None) from None
    served = lease.engine
    try:
        pooling = pooling_for(served.llm.policy.pooling, normalize=normalize)
        request_id = f"embd-{time.time_ns():x}"
        runs = [
            embed(served.llm, prompt, pooling, f"{request_id}-{index}", served.adapter_of(model))
            for index, prompt in enumerate(inputs)
        ]
        return list(await asyncio.gather(*runs))
    except EngineError as e:  # the engine's refusal of an input (a 4xx) or its failure
        raise ApiError(e.status, e.message, param=field if e.status < 500 else None) from None
    finally:
        lease.release()


def _check_dimensions(asked: int | None, outputs: list[EmbeddingRequestOutput]) -> None:
    size = len(outputs[0].outputs.embedding)
    if asked is not None and asked != size:
        raise ApiError(
            400,
            f"'dimensions' must be the model's embedding size {size} (vectors are not "
            f"truncated), got {asked}",
            param="dimensions",
        )


def _encoded(output: EmbeddingRequestOutput, encoding: str) -> list[float] | str:
    vector = output.outputs.embedding
    if encoding == "base64":
        return base64.b64encode(float32_bytes(vector)).decode("ascii")
    return vector
