"""Rerank and score (issue 51): how close each document is to a query, as vLLM's score API
answers for an embedding model: the cosine similarity of the two texts' embeddings, each pooled
as /v1/embeddings pools it (engine/http/openai/embeddings.py), so every decoder model the engine
serves can rerank. The embeddings run through the engine as any request does (policy, limits,
metrics, aborts when the client leaves, restart recovery).

- POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape, as vLLM serves them) and
  llama-server's /reranking, /v1/reranking: `query`, `documents` (strings, or objects with a
  `text`), `top_n` (unset or 0: all), `return_documents`; the results ordered by
  `relevance_score`, highest first, each with the document's `index`.
- POST /score, /v1/score (vLLM's): `text_1` and `text_2`, each a string or a list of strings: one
  against many, or pairs of two lists of one length; one `score` per pair, in order.

A text is embedded once however often it appears. Errors are OpenAI's shape, as vLLM's are, and
name the field (`query`, `documents`, `text_1`, `text_2`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.http.guards import until_disconnect
from engine.http.openai.decoding import decode_request
from engine.http.openai.embeddings import embed_all
from engine.http.openai.errors import ApiError, outcome_of
from engine.http.openai.parsing import check_model
from engine.http.state import ServerState
from engine.request.outputs import EmbeddingRequestOutput

JSON = "application/json"
Size = Annotated[int, msgspec.Meta(ge=0)]


class Document(msgspec.Struct):
    text: str


class RerankRequest(msgspec.Struct, kw_only=True):
    query: str
    documents: list[str | Document]
    model: str | None = None
    top_n: Size | None = None  # unset or 0: every document
    return_documents: bool = True
    # Cohere's: a document is never cut here, so a bound on its tokens cannot be honoured.
    max_tokens_per_doc: int | None = None


class RerankResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    index: int
    relevance_score: float
    document: Document | None = None


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    usage: Usage
    results: list[RerankResult]


class ScoreRequest(msgspec.Struct, kw_only=True):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None


class ScoreData(msgspec.Struct, kw_only=True):
    index: int
    score: float
    object: str = "score"


class ScoreResponse(msgspec.Struct, kw_only=True):
    id: str
    model: str
    data: list[ScoreData]
    usage: Usage
    created: int
    object: str = "list"


_RERANK = msgspec.json.Decoder(RerankRequest)
_SCORE = msgspec.json.Decoder(ScoreRequest)
RERANK_PATHS = ("/rerank", "/v1/rerank", "/v2/rerank", "/reranking", "/v1/reranking")
SCORE_PATHS = ("/score", "/v1/score")


Serve = Callable[[Request, ServerState], Awaitable[Response]]


def rerank_routes(state: ServerState) -> list[Route]:
    def counted(endpoint: str, serve: Serve) -> Callable[[Request], Awaitable[Response]]:
        async def handle(request: Request) -> Response:
            try:
                return await serve(request, state)
            except ApiError as e:
                state.metrics.count_request(endpoint, outcome_of(e.status))
                raise

        return handle

    rerank, score = counted("rerank", _rerank), counted("score", _score)
    routes = [Route(path, rerank, methods=["POST"]) for path in RERANK_PATHS]
    return routes + [Route(path, score, methods=["POST"]) for path in SCORE_PATHS]


async def _rerank(request: Request, state: ServerState) -> Response:
    body = await _body(request, state)
    req = decode_request(_RERANK, body)
    model = check_model(req.model, state.served_names)
    if req.max_tokens_per_doc is not None:
        raise ApiError(
            400,
            "'max_tokens_per_doc' is not supported: documents are scored whole",
            param="max_tokens_per_doc",
        )
    documents = [d if isinstance(d, str) else d.text for d in req.documents]
    _check_texts([req.query], "query")
    _check_texts(documents, "documents")
    texts = ([req.query], documents)
    scored = await _scores(request, state, model, *texts, "rerank", ("query", "documents"))
    if scored is None:
        return Response(status_code=499)
    scores, tokens = scored
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[: req.top_n or None]
    results = [
        RerankResult(
            index=i,
            relevance_score=scores[i],
            document=Document(documents[i]) if req.return_documents else None,
        )
        for i in order
    ]
    response = RerankResponse(
        id=f"rerank-{time.time_ns():x}", model=model, usage=_usage(tokens), results=results
    )
    return Response(msgspec.json.encode(response), media_type=JSON)


async def _score(request: Request, state: ServerState) -> Response:
    body = await _body(request, state)
    req = decode_request(_SCORE, body)
    model = check_model(req.model, state.served_names)
    firsts = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    seconds = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    _check_texts(firsts, "text_1")
    _check_texts(seconds, "text_2")
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise ApiError(
            400,
            f"'text_1' has {len(firsts)} texts and 'text_2' {len(seconds)}: give one text_1, "
            "or as many as text_2 (one score per pair)",
            param="text_1",
        )
    scored = await _scores(request, state, model, firsts, seconds, "score", ("text_1", "text_2"))
    if scored is None:
        return Response(status_code=499)
    scores, tokens = scored
    response = ScoreResponse(
        id=f"score-{time.time_ns():x}",
        model=model,
        data=[ScoreData(index=i, score=score) for i, score in enumerate(scores)],
        usage=_usage(tokens),
        created=int(time.time()),
    )
    return Response(msgspec.json.encode(response), media_type=JSON)


async def _body(request: Request, state: ServerState) -> bytes:
    if state.draining:
        raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
    state.authorize(request)
    return await state.read_body(request)


def _check_texts(texts: Sequence[str], field: str) -> None:
    if not texts:
        raise ApiError(400, f"'{field}' must not be empty", param=field)
    for index, text in enumerate(texts):
        if not text:
            where = field if len(texts) == 1 else f"{field}[{index}]"
            raise ApiError(400, f"'{where}' must not be an empty text", param=field)


async def _scores(
    request: Request,
    state: ServerState,
    model: str,
    firsts: list[str],
    seconds: list[str],
    endpoint: str,
    fields: tuple[str, str],
) -> tuple[list[float], int] | None:
    """The cosine similarity of each pair (one first against every second, or pairs in order)
    and the prompt tokens embedded; None when the client left (its requests aborted)."""
    metrics = state.metrics.for_model(state.base_of(model))
    vectors = await until_disconnect(
        request, _embed_each(state, model, {fields[0]: firsts, fields[1]: seconds})
    )
    if vectors is None:
        metrics.count_request(endpoint, "aborted")
        return None
    embedded, tokens = vectors
    pairs = zip(firsts * len(seconds) if len(firsts) == 1 else firsts, seconds, strict=True)
    scores = [_cosine(embedded[first], embedded[second]) for first, second in pairs]
    metrics.count_request(endpoint, "success")
    metrics.add_prompt_tokens(tokens)
    return scores, tokens


async def _embed_each(
    state: ServerState, model: str, texts: dict[str, list[str]]
) -> tuple[dict[str, list[float]], int]:
    """Each distinct text's embedding, and the prompt tokens they took. The texts of each field
    run as one batch (a refusal names its field), both at once: one failing cancels the other."""
    batches: list[tuple[list[str], asyncio.Task[list[EmbeddingRequestOutput]]]] = []
    seen: set[str] = set()
    for field, field_texts in texts.items():
        distinct = [text for text in dict.fromkeys(field_texts) if text not in seen]
        seen.update(distinct)
        if distinct:
            batch = asyncio.create_task(embed_all(state, model, distinct, field=field))
            batches.append((distinct, batch))
    try:
        await asyncio.gather(*(batch for _, batch in batches))
    except BaseException:
        for _, batch in batches:
            batch.cancel()  # their engine requests are aborted
        raise
    vectors: dict[str, list[float]] = {}
    tokens = 0
    for distinct, batch in batches:
        for text, output in zip(distinct, batch.result(), strict=True):
            vectors[text] = output.outputs.embedding
            tokens += len(output.prompt_token_ids)
    return vectors, tokens


def _cosine(a: Sequence[float], b: Sequence[float]) -> float:
    norms = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return math.fsum(x * y for x, y in zip(a, b, strict=True)) / norms if norms else 0.0


def _usage(tokens: int) -> Usage:
    return Usage(prompt_tokens=tokens, total_tokens=tokens)
