"""The Starlette app: OpenAI-compatible routes plus health, version and metrics.

Every failure becomes an OpenAI error body (`{"error": {message, type, param, code}}`) with its
status; a failed request leaves nothing behind, so the next one is served normally.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.http.adapted_routes import adapted_api_routes
from engine.http.guards import until_disconnect
from engine.http.metrics import CONTENT_TYPE
from engine.http.model_routes import model_routes, model_tokens
from engine.http.ollama.routes import ollama_routes
from engine.http.openai.decoding import decode_request
from engine.http.openai.embeddings import embedding_routes
from engine.http.openai.errors import INTERNAL_ERROR_MESSAGE, ApiError, outcome_of
from engine.http.openai.lora_routes import lora_routes
from engine.http.openai.operations import (
    AbortRequest,
    abort_request,
    cors_middleware,
    take_client_request_id,
)
from engine.http.openai.parsing import OpenAIRequest, parse_chat, parse_completion
from engine.http.openai.protocol import encode
from engine.http.openai.recording import RequestRecording
from engine.http.openai.render import render_routes
from engine.http.openai.rerank import rerank_routes
from engine.http.openai.runs import RequestRun
from engine.http.served import pool_health
from engine.http.state import ServerState
from engine.http.streams import ReleasingStream
from engine.http.ui.page import chat_page_routes
from engine.telemetry.tracer import trace_headers

log = logging.getLogger("engine.http")

JSON = "application/json"
_ABORT = msgspec.json.Decoder(AbortRequest)

Parser = Callable[[bytes, tuple[str, ...]], OpenAIRequest]
T = TypeVar("T")


def build_app(state: ServerState) -> Starlette:
    routes = [
        *_api_routes(state),
        # /v1/responses and /v1/messages, run as chat requests
        *adapted_api_routes(state),
        *embedding_routes(state),
        # /rerank, /v1/rerank, /v2/rerank, /reranking, /score: cosines of embeddings
        *rerank_routes(state),
        # /v1/chat/completions/render: a chat request's prompt and parameters, not run
        *render_routes(state),
        *ollama_routes(state),
        *_probe_routes(state),
        # /v1/models with each model's state; /models/load, /models/unload
        *model_routes(state),
        *_token_routes(state),
        *lora_routes(state),  # /v1/load_lora_adapter, unload
        *chat_page_routes(state),  # GET /: the chat page, unless --no-ui
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        ApiError: _api_error_response,
        HTTPException: _http_exception_response,
        Exception: _internal_error_response,
    }
    return Starlette(
        routes=routes, exception_handlers=handlers, middleware=cors_middleware(state.settings)
    )


def _api_routes(state: ServerState) -> list[Route]:
    """The OpenAI API, the version and the metrics."""

    async def completions(request: Request) -> Response:
        return await _generate(request, state, parse_completion, "completions")

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, state, parse_chat, "chat_completions")

    async def version_route(request: Request) -> Response:
        # And whether greedy and seeded outputs are reproducible (engine replay --compare).
        deterministic = state.settings.model.deterministic
        return _json(200, {"version": engine_version(), "deterministic": deterministic})

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/version", version_route, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]


def _probe_routes(state: ServerState) -> list[Route]:
    """Liveness (/health) and readiness (/ready), as Kubernetes probes read them."""

    async def health(request: Request) -> Response:
        """Liveness: 503 only once the engine has given up. An actor being restarted is the
        engine healing itself; a liveness probe that failed then would restart the pod."""
        report = pool_health(state.models)
        if report.reason is not None:
            return _json(503, {"status": "failed", "reason": report.reason})
        if state.draining:
            return _json(200, {"status": "draining"})
        if not report.ready:
            return _json(200, {"status": "restarting", "not_ready": report.not_ready})
        return _json(200, {"status": "ok"})

    async def ready(request: Request) -> Response:
        """Readiness: 200 only while new requests can be served now."""
        report = pool_health(state.models)
        if state.draining:
            return _json(503, {"status": "draining"})
        if report.ready:
            return _json(200, {"status": "ready"})
        body = {"status": "unavailable", "not_ready": report.not_ready, "reason": report.reason}
        return _json(503, body)

    return [Route("/health", health, methods=["GET"]), Route("/ready", ready, methods=["GET"])]


def _token_routes(state: ServerState) -> list[Route]:
    """vLLM's /tokenize, /detokenize and /abort."""

    async def tokenize(request: Request) -> Response:
        state.authorize(request)
        body = await state.read_body(request)
        async with model_tokens(state, body) as tokens:
            return Response(await tokens.tokenize(body), media_type=JSON)

    async def detokenize(request: Request) -> Response:
        state.authorize(request)
        body = await state.read_body(request)
        async with model_tokens(state, body) as tokens:
            return Response(await tokens.detokenize(body), media_type=JSON)

    async def abort(request: Request) -> Response:
        tenant = state.authorize(request)
        body = await state.read_body(request)
        request_id = decode_request(_ABORT, body).request_id
        if not await abort_request(state, request_id, tenant):
            raise ApiError(
                404, f"no request {request_id!r} is in flight", param="request_id", code="not_found"
            )
        return _json(200, {"aborted": request_id})

    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/abort", abort, methods=["POST"]),
    ]


async def _generate(request: Request, state: ServerState, parse: Parser, endpoint: str) -> Response:
    try:
        if state.draining:
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
        tenant = state.authorize(request)
        body = await state.read_body(request)
        prepared = _parse(parse, body, state.served_names, request.url.path)
        take_client_request_id(prepared, request.headers.get("x-request-id"), state.runs, tenant)
    except ApiError as e:
        state.metrics.count_request(endpoint, outcome_of(e.status))
        raise
    except Exception:  # answered by the generic 500; the run below counts its own end
        state.metrics.count_request(endpoint, outcome_of(500))
        raise
    recording = RequestRecording(endpoint, body, time.time()) if state.recording else None
    run = RequestRun(state, prepared, endpoint, recording, tenant=tenant)
    run.trace_headers = trace_headers(request.headers)
    if prepared.stream:
        firsts = await until_disconnect(request, run.open())
        if firsts is None:  # left while queued or prefilling
            run.abort_unfinished()
            run.finish()
            return Response(status_code=499)
        # The run is released by the response, not (only) by its event generator: a client
        # that leaves before the first body step leaves that generator never started.
        return ReleasingStream(
            run.sse(firsts),
            run.release,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": run.client_key},
        )
    result = await until_disconnect(request, run.collect())
    if result is None:  # the client left; its engine requests were aborted
        run.abort_unfinished()
        run.finish()  # once only: also when collect() was cancelled before it began
        return Response(status_code=499)
    return Response(result, media_type=JSON, headers={"X-Request-Id": run.client_key})


def _parse(parse: Parser, body: bytes, model_name: tuple[str, ...], path: str) -> OpenAIRequest:
    """Parse a body; a failure the parser did not foresee is still the body's fault (a 400),
    logged with its traceback so that the gap in the parser can be closed."""
    try:
        return parse(body, model_name)
    except ApiError:
        raise
    except Exception:
        log.exception("unforeseen failure parsing a %s request body", path)
        raise ApiError(400, f"the request body is not a valid {path} request") from None


def _json(status: int, body: Any) -> Response:
    return Response(encode(body), status_code=status, media_type=JSON)


async def _api_error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return Response(exc.encoded(), status_code=exc.status, media_type=JSON, headers=exc.headers)


async def _http_exception_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = f"{request.method} {request.url.path}: {exc.detail}"
    error = ApiError(exc.status_code, message, code=None if exc.status_code != 404 else "not_found")
    return Response(error.encoded(), status_code=exc.status_code, media_type=JSON)


async def _internal_error_response(request: Request, exc: Exception) -> Response:
    # The details go to the server log (uvicorn logs the exception Starlette re-raises after
    # this answer), not to the client: they may describe internals. uvicorn closes the
    # connection once that exception reaches it; without `Connection: close` the client would
    # keep the connection in its pool and could send its next request on it as it closes.
    error = ApiError(500, INTERNAL_ERROR_MESSAGE)
    return Response(
        error.encoded(), status_code=500, media_type=JSON, headers={"Connection": "close"}
    )


def engine_version() -> str:
    try:
        return version("engine")
    except PackageNotFoundError:
        return "unknown"
