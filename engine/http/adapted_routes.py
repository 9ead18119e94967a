"""The routes of the APIs served over the chat path: OpenAI's Responses API (/v1/responses) and
Anthropic's Messages API (/v1/messages).

Anthropic's /v1/messages/count_tokens counts the prompt a Messages request would run.

A request of either is turned into a chat run by its Adapter (an EngineRequest built straight
from the API's body), which runs as /v1/chat/completions runs one: the same request policy,
limits, metrics, aborts, request ids and actor restarts. The chat answer, read from the engine's
outputs, is then reshaped into the API's own object or events.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Protocol, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine.http.anthropic.adapter import (
    MessagesAdapter,
    count_tokens_request,
    messages_error_body,
)
from engine.http.guards import until_disconnect
from engine.http.model_routes import model_tokens
from engine.http.openai.chat_relay import ChatResult, ChatStep, ChatSteps, chat_result
from engine.http.openai.errors import INTERNAL_ERROR_MESSAGE, ApiError, outcome_of
from engine.http.openai.operations import take_client_request_id
from engine.http.openai.parsing import OpenAIRequest
from engine.http.openai.recording import RequestRecording, chat_body
from engine.http.openai.responses.adapter import ResponsesAdapter
from engine.http.openai.responses.store import ResponseStore
from engine.http.openai.runs import RequestRun
from engine.http.state import ServerState
from engine.http.streams import ReleasingStream
from engine.messages.requests import ChatOptions
from engine.telemetry.tracer import trace_headers
from engine.tenants.table import Tenant

log = logging.getLogger("engine.http")
T = TypeVar("T")

JSON = "application/json"


class Adapter(Protocol):
    """One request of another API, as a chat run, and how its answer is shaped back."""

    id_prefix: str  # of the API's object id: resp_, msg_
    api: OpenAIRequest  # the chat run it is
    stream: bool

    def final_body(self, api_id: str, result: ChatResult) -> bytes: ...

    def events(
        self, api_id: str, input_tokens: int, steps: AsyncIterator[ChatStep]
    ) -> AsyncGenerator[bytes, None]: ...


def adapted_api_routes(state: ServerState) -> list[Route]:
    store = ResponseStore(state.settings.server.responses_store_size)

    async def responses(request: Request) -> Response:
        def adapt(tenant: Tenant, body: bytes) -> Adapter:
            # Stored responses are the tenant's own: another's ids find nothing.
            return ResponsesAdapter(body, state.served_names, store.scoped(tenant.name))

        return await serve_adapted(request, state, "responses", adapt)

    async def messages(request: Request) -> Response:
        def adapt(tenant: Tenant, body: bytes) -> Adapter:
            return MessagesAdapter(body, state.served_names)

        try:
            return await serve_adapted(request, state, "messages", adapt, x_api_key=True)
        except ApiError as e:
            return _messages_error(e)
        except Exception:
            log.exception("a /v1/messages request failed")
            return Response(
                messages_error_body(500, INTERNAL_ERROR_MESSAGE),
                status_code=500,
                media_type=JSON,
                headers={"Connection": "close"},
            )

    async def count_tokens(request: Request) -> Response:
        try:
            return await _count_tokens(request, state)
        except ApiError as e:
            state.metrics.count_request("count_tokens", outcome_of(e.status))
            return _messages_error(e)

    async def stored_response(request: Request) -> Response:
        """GET /v1/responses/{id}: a stored Response; DELETE drops it."""
        own = store.scoped(state.authorize(request).name)
        response_id = request.path_params["response_id"]
        if request.method == "DELETE":
            if not own.delete(response_id):
                raise _no_response(response_id)
            deleted = {"id": response_id, "object": "response.deleted", "deleted": True}
            return Response(msgspec.json.encode(deleted), media_type=JSON)
        response = own.response(response_id)
        if response is None:
            raise _no_response(response_id)
        return Response(msgspec.json.encode(response), media_type=JSON)

    return [
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]


async def _count_tokens(request: Request, state: ServerState) -> Response:
    """Anthropic's token count: the prompt /v1/messages would run for the same system,
    messages and tools, rendered and tokenized as that request's would be."""
    if state.draining:
        raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
    state.authorize(request, x_api_key=True)
    body = await state.read_body(request)
    api = _adapt(lambda raw: count_tokens_request(raw, state.served_names), body, request.url.path)
    (chat,) = api.requests
    assert chat.messages is not None
    async with model_tokens(state, body) as tokens:
        ids = await tokens.chat_tokens(chat.messages, chat.chat or ChatOptions())
    state.metrics.for_model(state.base_of(api.model)).count_request("count_tokens", "success")
    return Response(msgspec.json.encode({"input_tokens": len(ids)}), media_type=JSON)


def _no_response(response_id: str) -> ApiError:
    return ApiError(
        404,
        f"no response {response_id!r} is stored here (unknown, made with store false, deleted, "
        "or dropped past server.responses_store_size)",
        param="response_id",
    )


def _messages_error(e: ApiError) -> Response:
    return Response(
        messages_error_body(e.status, e.message),
        status_code=e.status,
        media_type=JSON,
        headers=e.headers,
    )


async def serve_adapted(
    request: Request,
    state: ServerState,
    endpoint: str,
    adapt: Callable[[Tenant, bytes], Adapter],
    *,
    x_api_key: bool = False,
) -> Response:
    try:
        if state.draining:
            raise ApiError(503, "the server is shutting down", headers={"Retry-After": "5"})
        tenant = state.authorize(request, x_api_key=x_api_key)
        body = await state.read_body(request)
        adapter = _adapt(functools.partial(adapt, tenant), body, request.url.path)
        runs = state.runs
        take_client_request_id(adapter.api, request.headers.get("x-request-id"), runs, tenant)
    except ApiError as e:
        state.metrics.count_request(endpoint, outcome_of(e.status))
        raise
    api_id = adapter.id_prefix + adapter.api.request_id.partition("-")[2]
    recording = None
    if state.recording:  # the trace holds the chat request it ran as: replayable
        chat = chat_body(adapter.api.requests[0], adapter.stream)
        recording = RequestRecording("chat_completions", chat, time.time())
    run = RequestRun(state, adapter.api, endpoint, recording, tenant=tenant)
    run.trace_headers = trace_headers(request.headers)
    headers = {"X-Request-Id": run.client_key}
    if adapter.stream:
        firsts = await until_disconnect(request, run.open())
        if firsts is None:  # left while queued or prefilling
            run.abort_unfinished()
            run.finish()
            return Response(status_code=499)
        input_tokens = sum(len(first.prompt_token_ids) for _, first in firsts)
        steps_run = run.relay(firsts, ChatSteps(run.builder))
        events = _events(adapter, api_id, input_tokens, steps_run)
        headers["Cache-Control"] = "no-cache"
        return ReleasingStream(events, run.release, media_type="text/event-stream", headers=headers)
    ran = await until_disconnect(request, _run_to_end(run))
    if ran is None:  # the client left; its engine requests were aborted
        run.abort_unfinished()
        run.finish()
        return Response(status_code=499)
    answer = adapter.final_body(api_id, chat_result(run.builder))
    return Response(answer, media_type=JSON, headers=headers)


async def _run_to_end(run: RequestRun) -> bool:
    await run.run_to_end()
    return True


def _adapt(adapt: Callable[[bytes], T], body: bytes, path: str) -> T:
    """The body's chat run; a failure the adapter did not foresee is still the body's fault (a
    400), logged with its traceback."""
    try:
        return adapt(body)
    except ApiError:
        raise
    except Exception:
        log.exception("unforeseen failure parsing a %s request body", path)
        raise ApiError(400, f"the request body is not a valid {path} request") from None


async def _events(
    adapter: Adapter, api_id: str, input_tokens: int, steps: AsyncGenerator[ChatStep, None]
) -> AsyncGenerator[bytes, None]:
    async with (
        contextlib.aclosing(steps),
        contextlib.aclosing(adapter.events(api_id, input_tokens, steps)) as events,
    ):
        async for event in events:
            yield event
