"""Request ids chosen by the client (X-Request-Id or the body's request_id), `POST /abort`, and
CORS for browser clients (off unless server.allowed_origins names some)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

from engine.http.openai.errors import ApiError
from engine.http.openai.parsing import OpenAIRequest
from engine.settings import Settings
from engine.tenants.access import scoped_id
from engine.tenants.table import EVERYONE, Tenant

if TYPE_CHECKING:
    from engine.http.state import ServerState

MAX_REQUEST_ID_CHARS = 256


class AbortRequest(msgspec.Struct, kw_only=True):
    request_id: str


def take_client_request_id(
    api: OpenAIRequest,
    header: str | None,
    in_flight: Mapping[str, Any],
    tenant: Tenant = EVERYONE,
) -> None:
    """Make the client's id (the header wins over the body's, as in vLLM) the request's id:
    the engine request's, the response's X-Request-Id and, prefixed, its body id. Engine
    request ids are the tenant's own (scoped_id): two tenants may use one id, and neither
    reaches the other's request by it."""
    request_id = header if header is not None else api.client_request_id
    if request_id is not None:
        _check_client_id(request_id, "X-Request-Id" if header is not None else "request_id")
        if scoped_id(tenant, request_id) in in_flight:
            param = "X-Request-Id" if header is not None else "request_id"
            raise ApiError(400, f"request id {request_id!r} is already in flight", param=param)
        api.client_request_id = request_id
        kind = api.request_id.partition("-")[0]  # cmpl | chatcmpl
        api.request_id = f"{kind}-{request_id}"
    api.name_engine_requests()
    for request in api.requests:
        request.request_id = scoped_id(tenant, request.request_id or "")


def _check_client_id(request_id: str, param: str) -> None:
    if not request_id or len(request_id) > MAX_REQUEST_ID_CHARS or not request_id.isprintable():
        raise ApiError(
            400,
            f"'{param}' must be 1 to {MAX_REQUEST_ID_CHARS} printable characters",
            param=param,
        )


async def abort_request(state: ServerState, request_id: str, tenant: Tenant = EVERYONE) -> bool:
    """Abort an API request by the id its response carries in X-Request-Id (every engine
    request of it), or an engine request by its own id; False if none is in flight. Only the
    tenant's own: ids are looked up in its namespace (scoped_id)."""
    request_id = scoped_id(tenant, request_id)
    run = state.runs.get(request_id)
    engines = [served.llm for _, served in state.models.loaded()]
    if run is None:
        return any([await llm.abort(request_id) for llm in engines])
    engine_ids = [request.request_id for request in run.api.requests]
    aborted = [await llm.abort(eid) for eid in engine_ids if eid for llm in engines]
    return any(aborted)


def cors_middleware(settings: Settings) -> list[Middleware]:
    server = settings.server
    if not server.allowed_origins:
        return []  # no CORS headers at all: browsers on other origins are refused
    return [
        Middleware(
            CORSMiddleware,
            allow_origins=list(server.allowed_origins),
            allow_methods=list(server.allowed_methods),
            allow_headers=list(server.allowed_headers),
            allow_credentials=server.allow_credentials,
        )
    ]
