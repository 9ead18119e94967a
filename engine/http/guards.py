"""The request guards every HTTP front of the engine shares: the server's routes (every API, the
chat page's JSON routes) and the P/D proxy (engine/proxy/). One behaviour for both; each refusal
is an ApiError, answered by each front in its error shape.

- The API key: `Authorization: Bearer <key>`, compared in constant time; a header that is not
  ASCII (a bearer token is, RFC 6750) is a 400 naming it, any other mismatch a 401 asking for the
  header. Anthropic's clients may send the key as `x-api-key` instead (`x_api_key`). With a
  tenants file, the key sent (`sent_key`) names its tenant instead (ServerState.authorize).
- The body: past `limit` bytes, declared or sent, a 413 naming the limit; the rest of an
  oversized body is read and dropped (up to 256 MiB), so that the client reads the 413 instead
  of a reset connection. A client gone before its body ended gets a 499 (nginx's "client closed
  request"): nobody reads it, and nothing counts it as the server's failure.
- A client that disconnects while its answer is prepared: the work is cancelled (aborting what
  it started).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import ClientDisconnect, Request

from engine.http.openai.errors import ApiError

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499
# Past this many bytes an oversized body is no longer read to the end before answering 413.
_DISCARD_LIMIT = 256 * 1024 * 1024


def authorize(request: Request, key: str | None, *, x_api_key: bool = False) -> None:
    """ApiError (400, 401) unless the request carries `key` (None or "": no key is needed).
    `x_api_key`: the key may come as Anthropic's `x-api-key` header too."""
    if not key:
        return
    sent = request.headers.get("x-api-key") if x_api_key else None
    if sent is not None:
        if not _same(_ascii(sent, "x-api-key"), key):
            raise _unauthorized("invalid API key in the 'x-api-key' header")
        return
    header = _ascii(request.headers.get("authorization", ""), "Authorization")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not _same(token, key):
        raise _unauthorized("missing or invalid API key")


def sent_key(request: Request, *, x_api_key: bool = False) -> str:
    """The key the request carries ("" for none): its bearer token, or with `x_api_key` its
    `x-api-key` header where it has one; ApiError 400 for a header that is not ASCII."""
    sent = request.headers.get("x-api-key") if x_api_key else None
    if sent is not None:
        return _ascii(sent, "x-api-key").strip()
    header = _ascii(request.headers.get("authorization", ""), "Authorization")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def unauthorized_key() -> ApiError:
    """The 401 for a key that names no tenant (tenants: engine/tenants/)."""
    return _unauthorized("missing or invalid API key")


def _ascii(value: str, header: str) -> str:
    if not value.isascii():  # a bearer token is ASCII (RFC 6750)
        raise ApiError(
            400,
            f"the {header} header holds non-ASCII bytes; send 'Authorization: Bearer <key>'",
            param=header,
        )
    return value


def _same(sent: str, key: str) -> bool:
    # As bytes: compare_digest refuses a str holding non-ASCII, which the configured key may.
    return secrets.compare_digest(sent.strip().encode(), key.encode())


def _unauthorized(what: str) -> ApiError:
    message = f"{what}: send 'Authorization: Bearer <key>'"
    return ApiError(401, message, headers={"WWW-Authenticate": "Bearer"})


async def read_body(request: Request, limit: int, setting: str) -> bytes:
    """The whole body; ApiError 413 past `limit` bytes (`setting` names where the limit is
    set), 499 when the client leaves before sending all of it."""
    declared = request.headers.get("content-length", "")
    too_big = declared.isdigit() and int(declared) > limit
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            too_big = too_big or size > limit
            if too_big and size > _DISCARD_LIMIT:
                break
            if not too_big:
                chunks.append(chunk)
    except ClientDisconnect:
        # Gone before its body ended (or closed at server.body_timeout, answered 408 already).
        raise ApiError(
            CLIENT_CLOSED_REQUEST,
            "the client closed the connection before sending its whole body",
        ) from None
    if too_big:
        raise ApiError(
            413,
            f"request body of {max(size, int(declared or 0))} bytes is over the limit of "
            f"{limit} bytes ({setting})",
        )
    return b"".join(chunks)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result; or None, `work` cancelled, if the client disconnects first (its body has
    been read already: what the server receives next is the disconnect)."""
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
