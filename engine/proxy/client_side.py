"""The proxy's side facing its clients: authorization, the body, the headers passed on to the
instances, and noticing a client that leaves before its answer."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import uuid
from collections.abc import Awaitable

from starlette.requests import Request
from starlette.responses import Response

from engine.proxy.pd import error_body

JSON = "application/json"
# Request headers the instances see; the rest (hop-by-hop, host, lengths) are the proxy's own.
FORWARDED_HEADERS = ("authorization", "content-type", "accept", "traceparent", "tracestate")
CLIENT_CLOSED_REQUEST = 499


class BodyTooLarge(Exception):
    pass


def unauthorized(request: Request, key: str | None) -> Response | None:
    """A 401 unless the request carries the proxy's API key `key` (None when none is set)."""
    if not key:
        return None
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and secrets.compare_digest(
        token.strip().encode(errors="replace"), key.encode()
    ):
        return None
    message = "missing or invalid API key: send 'Authorization: Bearer <key>'"
    body = error_body(message, 401, "invalid_request_error")
    return Response(body, 401, {"WWW-Authenticate": "Bearer"}, media_type=JSON)


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body; BodyTooLarge past `limit` bytes, declared or sent."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        chunks.append(chunk)
    return b"".join(chunks)


async def unless_client_leaves(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response; or, if the client disconnects first, `work` cancelled and a 499 (as
    nginx logs it) that no one reads."""
    answer = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            answer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        return await answer
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _disconnect(request: Request) -> None:
    """Returns once the client has disconnected (its body has been read already: what the
    server receives next is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def upstream_headers(request: Request) -> dict[str, str]:
    """The client's Authorization (and content type) for the instances, and one X-Request-Id
    that the prefill and the decode instance both see (made up when the client sent none)."""
    headers = {k: v for k in FORWARDED_HEADERS if (v := request.headers.get(k)) is not None}
    headers["x-request-id"] = request.headers.get("x-request-id") or uuid.uuid4().hex
    # Streams are relayed as raw bytes: an instance must not compress them (httpx would ask for
    # gzip by default, and the client would get gzip bytes without their content-encoding).
    headers["accept-encoding"] = "identity"
    return headers
