"""A streamed request is released however its client leaves, even before the response's first
body step (issue 31, item 1). Driven at the ASGI level against a real engine, so the disconnect
can be delivered at the one moment that cannot be forced from outside: after the response has
begun, before the body generator has run once. Then the run, its gateway record and its KV
blocks must be gone and its X-Request-Id free again."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from engine import AsyncLLM
from engine.http.app import build_app
from engine.http.state import ServerState
from engine.library.llm import build_settings
from tests.checkpoints import tiny_checkpoint
from tests.holds import HOLD_TEXT, holding

REQUEST_ID = "vanishing-client-1"
# Held (tests/holds.py): 10 s of tokens on any machine, so only the release can end it early.
BODY = json.dumps(
    {"prompt": "hello" + HOLD_TEXT, "max_tokens": 500, "ignore_eos": True, "stream": True}
).encode()


def scope() -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(BODY)).encode()),
            (b"x-request-id", REQUEST_ID.encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


async def leave_before_the_first_body_step(app: Any) -> list[str]:
    """Send the request; once the response has started, the client is gone: every later
    receive() is a disconnect, and the response-start send() waits until Starlette's
    disconnect listener has seen it, so the body sender is cancelled before its first step."""
    body_sent = False
    started = asyncio.Event()
    disconnect_seen = asyncio.Event()
    sent: list[str] = []

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await started.wait()
        disconnect_seen.set()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message["type"])
        if message["type"] == "http.response.start":
            started.set()
            await disconnect_seen.wait()
            await asyncio.sleep(0.05)  # the listener's task group cancels us here

    await asyncio.wait_for(app(scope(), receive, send), timeout=30)
    return sent


async def test_a_client_gone_before_the_first_body_step_leaves_nothing_behind() -> None:
    settings = build_settings(
        **{
            "model.path": str(tiny_checkpoint("qwen3")),
            "cache.kv_cache_memory": 4 * 2**20,
            "model.max_model_len": 1024,
        }
    )
    with holding():
        state = ServerState.create(settings)
        await state.models.start()  # the one model, as the server starts it
        try:
            ((_, served),) = state.models.loaded()
            await _leave_twice_and_find_nothing_left(state, served.llm)
        finally:
            await state.models.close()


async def _leave_twice_and_find_nothing_left(state: ServerState, llm: AsyncLLM) -> None:
    app = build_app(state)
    for _ in range(2):  # the second time, the same X-Request-Id must be accepted again
        sent = await leave_before_the_first_body_step(app)
        assert sent == ["http.response.start"]  # no body step ran
        deadline = time.monotonic() + 10.0  # a bound for a loaded machine, not a timing
        while (state.runs or llm.requests()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not state.runs, "the run was never released"
        assert not llm.requests(), "the engine request runs on"
    deadline = time.monotonic() + 5.0
    while llm.stats().kv_usage and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert llm.stats().kv_usage == 0
