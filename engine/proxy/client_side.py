"""The proxy's side facing its clients: its guards (the server's, engine/http/guards.py, so that
the proxy and the instances refuse a client alike), answered in the proxy's error shape, and the
headers passed on to the instances."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable

from starlette.requests import Request
from starlette.responses import Response

from engine.http.guards import CLIENT_CLOSED_REQUEST, authorize, read_body, until_disconnect
from engine.http.openai.errors import ApiError
from engine.proxy.pd import error_body

JSON = "application/json"
# Request headers the instances see; the rest (hop-by-hop, host, lengths) are the proxy's own.
FORWARDED_HEADERS = ("authorization", "content-type", "accept", "traceparent", "tracestate")


def refusal(error: ApiError) -> Response:
    """A guard's refusal as the proxy answers its own errors (vLLM's proxy: numeric code)."""
    body = error_body(error.message, error.status, error.type)
    return Response(body, error.status, error.headers, media_type=JSON)


def unauthorized(request: Request, key: str | None) -> Response | None:
    """The refusal of a request without the proxy's API key `key` (None: none is set)."""
    try:
        authorize(request, key)
    except ApiError as error:
        return refusal(error)
    return None


async def body_or_refusal(request: Request, limit: int) -> bytes | Response:
    """The whole body, or the refusal of one over `limit` bytes (or cut short by its client)."""
    try:
        return await read_body(request, limit, "--max-request-bytes")
    except ApiError as error:
        return refusal(error)


async def unless_client_leaves(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response; or, if the client disconnects first, `work` cancelled and a 499 (as
    nginx logs it) that no one reads."""
    answer = await until_disconnect(request, work)
    return Response(status_code=CLIENT_CLOSED_REQUEST) if answer is None else answer


def upstream_headers(request: Request) -> dict[str, str]:
    """The client's Authorization (and content type) for the instances, and one X-Request-Id
    that the prefill and the decode instance both see (made up when the client sent none)."""
    headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
    headers["x-request-id"] = request.headers.get("x-request-id") or uuid.uuid4().hex
    # Streams are relayed as raw bytes: an instance must not compress them (httpx would ask for
    # gzip by default, and the client would get gzip bytes without their content-encoding).
    headers["accept-encoding"] = "identity"
    return headers
