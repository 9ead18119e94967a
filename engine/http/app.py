"""The Starlette app: OpenAI-compatible routes plus health, version and metrics.

Every failure becomes an OpenAI error body (`{"error": {message, type, param, code}}`) with its
status; a failed request leaves nothing behind, so the next one is served normally.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from importlib.metadata import PackageNotFoundError, version
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from engine.http.errors import ApiError, outcome_of
from engine.http.metrics import CONTENT_TYPE
from engine.http.parsing import PreparedRequest, parse_chat, parse_completion
from engine.http.protocol import ModelCard, ModelList, encode
from engine.http.runs import RequestRun
from engine.http.state import ServerState

log = logging.getLogger("engine.http")

JSON = "application/json"
# Past this many bytes an oversized body is no longer read to the end before answering 413.
_DISCARD_LIMIT = 256 * 1024 * 1024

Parser = Callable[[bytes, str], PreparedRequest]
T = TypeVar("T")


def build_app(state: ServerState) -> Starlette:
    async def completions(request: Request) -> Response:
        return await _generate(request, state, parse_completion, "completions")

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, state, parse_chat, "chat_completions")

    async def models(request: Request) -> Response:
        _check_auth(request, state)
        card = ModelCard(
            id=state.model_name, created=state.started_at, max_model_len=state.max_model_len
        )
        return Response(encode(ModelList(data=[card])), media_type=JSON)

    async def health(request: Request) -> Response:
        if state.draining:
            return _json(503, {"status": "draining"})
        report = state.llm.health()
        if report.ready:
            return _json(200, {"status": "ok"})
        body = {"status": "unavailable", "not_ready": report.not_ready, "reason": report.reason}
        return _json(503, body)

    async def version_route(request: Request) -> Response:
        return _json(200, {"version": engine_version()})

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/version", version_route, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        ApiError: _api_error_response,
        HTTPException: _http_exception_response,
        Exception: _internal_error_response,
    }
    return Starlette(routes=routes, exception_handlers=handlers)


async def _generate(request: Request, state: ServerState, parse: Parser, endpoint: str) -> Response:
    try:
        if state.draining:
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
        _check_auth(request, state)
        body = await _read_body(request, state.settings.server.max_request_bytes)
        prepared = _parse(parse, body, state.model_name, request.url.path)
    except ApiError as e:
        state.metrics.requests.labels(endpoint, outcome_of(e.status)).inc()
        raise
    run = RequestRun(state, prepared, endpoint, body)
    if prepared.stream:
        firsts = await _until_disconnect(request, run.open())
        if firsts is None:  # left while queued or prefilling
            run.abort_unfinished()
            run.finish()
            return Response(status_code=499)
        return StreamingResponse(
            run.sse(firsts),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Request-Id": prepared.request_id},
        )
    result = await _until_disconnect(request, run.collect())
    if result is None:  # the client left; its engine requests were aborted
        return Response(status_code=499)
    return Response(result, media_type=JSON, headers={"X-Request-Id": prepared.request_id})


def _parse(parse: Parser, body: bytes, model_name: str, path: str) -> PreparedRequest:
    """Parse a body; a failure the parser did not foresee is still the body's fault (a 400),
    logged with its traceback so that the gap in the parser can be closed."""
    try:
        return parse(body, model_name)
    except ApiError:
        raise
    except Exception:
        log.exception("unforeseen failure parsing a %s request body", path)
        raise ApiError(400, f"the request body is not a valid {path} request") from None


def _check_auth(request: Request, state: ServerState) -> None:
    key = state.settings.server.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    if not header.isascii():  # a bearer token is ASCII (RFC 6750)
        raise ApiError(
            400,
            "the Authorization header holds non-ASCII bytes; send 'Authorization: Bearer <key>'",
            param="Authorization",
        )
    scheme, _, token = header.partition(" ")
    # As bytes: compare_digest refuses a str holding non-ASCII, which the configured key may.
    if scheme.lower() != "bearer" or not secrets.compare_digest(
        token.strip().encode(), key.encode()
    ):
        raise ApiError(
            401,
            "missing or invalid API key: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_big = True
        if too_big:
            # Read (and drop) the rest so the client sees the 413, not a reset connection.
            if size > _DISCARD_LIMIT:
                break
            continue
        chunks.append(chunk)
    if too_big:
        raise ApiError(
            413,
            f"request body of {max(size, int(declared or 0))} bytes is over the limit of "
            f"{limit} bytes (server.max_request_bytes)",
        )
    return b"".join(chunks)


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Run `work`, but cancel it (aborting its requests) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        watcher.cancel()
    if task.cancelled():
        return None
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
    # this answer), not to the client: they may describe internals.
    error = ApiError(500, "internal server error; the server log has the details")
    return Response(error.encoded(), status_code=500, media_type=JSON)


def engine_version() -> str:
    try:
        return version("engine")
    except PackageNotFoundError:
        return "unknown"
