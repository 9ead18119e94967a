"""The replay client: send a schedule to any OpenAI-compatible server and time every answer.

One dispatcher sleeps until each request's time, waits for a concurrency slot when
`max_concurrency` is set, and starts the request as its own task. Requests are streamed (SSE);
TTFT is the time to the first chunk carrying text, ITL the gaps between such chunks of one
choice, end-to-end the time to the end of the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from engine.trace.schedule import ScheduledRequest


@dataclass
class ReplayedChoice:
    text_parts: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    last_chunk_at: float | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass
class ReplayResult:
    """What one replayed request got back, and when (seconds after the replay started)."""

    request: ScheduledRequest
    sent_at: float = 0.0
    finished_at: float = 0.0
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    choices: dict[int, ReplayedChoice] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def e2e(self) -> float:
        return self.finished_at - self.sent_at


@dataclass(frozen=True)
class ClientOptions:
    url: str
    api_key: str | None = None
    max_concurrency: int | None = None
    timeout: float = 600.0


async def replay(
    schedule: list[ScheduledRequest],
    options: ClientOptions,
    on_done: Callable[[ReplayResult], None] | None = None,
) -> list[ReplayResult]:
    """Send every request at its time; return the results in schedule order."""
    if options.max_concurrency is not None and options.max_concurrency < 1:
        raise ValueError(f"max concurrency must be >= 1, got {options.max_concurrency}")
    slots = asyncio.Semaphore(options.max_concurrency or len(schedule) or 1)
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    limits = httpx.Limits(
        max_connections=options.max_concurrency or 1000, max_keepalive_connections=64
    )
    results = [ReplayResult(request) for request in schedule]
    async with httpx.AsyncClient(
        base_url=options.url.rstrip("/"),
        headers=headers,
        timeout=httpx.Timeout(options.timeout, connect=30.0),
        limits=limits,
    ) as client:
        start = time.perf_counter()

        def clock() -> float:
            return time.perf_counter() - start

        tasks: list[asyncio.Task[None]] = []
        for result in results:
            delay = result.request.send_at - clock()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            tasks.append(asyncio.create_task(_run_one(client, result, clock, slots, on_done)))
        await asyncio.gather(*tasks)
    return results


async def _run_one(
    client: httpx.AsyncClient,
    result: ReplayResult,
    clock: Callable[[], float],
    slots: asyncio.Semaphore,
    on_done: Callable[[ReplayResult], None] | None,
) -> None:
    result.sent_at = clock()
    try:
        await _send(client, result, clock)
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except Exception as e:  # a malformed answer must not stop the replay
        result.error = f"{type(e).__name__}: {e}"
    finally:
        result.finished_at = clock()
        slots.release()
        if on_done is not None:
            on_done(result)


async def _send(
    client: httpx.AsyncClient, result: ReplayResult, clock: Callable[[], float]
) -> None:
    request = result.request
    async with client.stream("POST", request.path, json=request.body) as response:
        result.status = response.status_code
        if response.status_code != 200:
            body = await response.aread()
            result.error = f"HTTP {response.status_code}: {_error_message(body)}"
            return
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            _absorb_whole(result, msgspec.json.decode(await response.aread()))
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            _absorb_chunk(result, msgspec.json.decode(data), clock())
            if result.error is not None:
                break


def _absorb_chunk(result: ReplayResult, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:
        result.error = f"error event: {_message_of(chunk['error'])}"
        return
    usage = chunk.get("usage")
    if usage:
        result.completion_tokens = int(usage.get("completion_tokens") or 0)
    for c in chunk.get("choices") or []:
        choice = result.choices.setdefault(int(c.get("index", 0)), ReplayedChoice())
        text = c.get("text")
        if text is None:
            text = (c.get("delta") or {}).get("content")
        if text:
            choice.text_parts.append(text)
            if result.ttft is None:
                result.ttft = now - result.sent_at
            if choice.last_chunk_at is not None:
                result.itls.append(now - choice.last_chunk_at)
            choice.last_chunk_at = now
        if c.get("finish_reason") is not None:
            choice.finish_reason = c["finish_reason"]


def _absorb_whole(result: ReplayResult, body: dict[str, Any]) -> None:
    """A server that answered without streaming: one body, no token timings."""
    usage = body.get("usage") or {}
    result.completion_tokens = int(usage.get("completion_tokens") or 0)
    for c in body.get("choices") or []:
        text = c.get("text")
        if text is None:
            text = (c.get("message") or {}).get("content") or ""
        result.choices[int(c.get("index", 0))] = ReplayedChoice([text], c.get("finish_reason"))


def _error_message(body: bytes) -> str:
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
        error = msgspec.json.decode(body).get("error")
        if error is not None:
            return _message_of(error)
    return body[:200].decode(errors="replace") or "(empty body)"


def _message_of(error: Any) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)
