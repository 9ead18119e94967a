"""Each kind of bad input gets its status and an OpenAI error body naming what was wrong, and
the server serves the next request normally."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_QUEUED, MAX_REQUEST_BYTES
from tests.e2e.harness import API_KEY, Server
from tests.holds import HOLD_TEXT

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def assert_still_serves(server: Server) -> None:
    with server.http() as http:
        resp = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1


def error_of(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("path", "raw", "param", "fragment"),
    [
        ("/v1/completions", b'{"prompt": "x",', None, "not valid JSON"),
        ("/v1/completions", b'{"prompt": "x", "temperature": "hot"}', "temperature", "float"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "max_tokens", ">= 1"),
        ("/v1/completions", b'{"prompt": "x", "top_p": 7}', "top_p", "(0, 1]"),
        ("/v1/completions", b'{"prompt": "x", "n": -1}', "n", ">= 1"),
        ("/v1/completions", b'{"max_tokens": 3}', "prompt", "missing"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "bot", "content": "x"}]}',
            "messages[0].role",
            "user",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": 1}]}',
            "messages[0].content",
            "",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "x"}], '
            b'"logprobs": true, "top_logprobs": 99}',
            "top_logprobs",
            "[0, 20]",
        ),
    ],
)
def test_malformed_or_out_of_range_is_400_naming_the_field(
    server: Server, path: str, raw: bytes, param: str | None, fragment: str
) -> None:
    with server.http() as http:
        resp = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    error = error_of(resp, 400)
    assert error["param"] == param
    assert fragment in error["message"]
    assert_still_serves(server)


def test_unknown_model_is_404(server: Server) -> None:
    with server.http() as http:
        resp = http.post("/v1/completions", json={"model": "no-such-model", "prompt": "x"})
    error = error_of(resp, 404)
    assert error["param"] == "model" and "no-such-model" in error["message"]
    assert_still_serves(server)


def test_prompt_plus_max_tokens_over_max_model_len_is_400_with_the_numbers(server: Server) -> None:
    prompt = [1 + i % 300 for i in range(1000)]
    with server.http() as http:
        resp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 50})
    error = error_of(resp, 400)
    assert str(MAX_MODEL_LEN) in error["message"]
    assert "1000" in error["message"] and "50" in error["message"]
    with server.http() as http:
        resp = http.post("/v1/completions", json={"prompt": "word " * 3000, "max_tokens": 1})
    error = error_of(resp, 400)
    assert str(MAX_MODEL_LEN) in error["message"]
    assert_still_serves(server)


def test_body_over_the_limit_is_413(server: Server) -> None:
    huge = json.dumps({"prompt": "x" * (MAX_REQUEST_BYTES + 10)}).encode()
    with server.http() as http:
        resp = http.post(
            "/v1/completions", content=huge, headers={"Content-Type": "application/json"}
        )
    error = error_of(resp, 413)
    assert str(MAX_REQUEST_BYTES) in error["message"]
    assert_still_serves(server)


def test_missing_or_wrong_api_key_is_401(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        with httpx.Client(base_url=server.url, timeout=30) as http:
            resp = http.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            error_of(resp, 401)
            assert error_of(http.get("/v1/models", headers=headers), 401)["code"]
    assert_still_serves(server)


async def test_queue_over_max_queued_samples_is_429_with_retry_after(server: Server) -> None:
    # Held (tests/holds.py): each admitted request runs >= 2 s, so the burst finds the slots
    # and the queue full on any machine.
    body = {"prompt": "tell me" + HOLD_TEXT, "max_tokens": 100, "ignore_eos": True, "stream": True}
    burst = MAX_NUM_SEQS + MAX_QUEUED + 6

    async def one(http: httpx.AsyncClient) -> tuple[int, dict[str, str], bytes]:
        async with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as resp:
            data = await resp.aread()
            return resp.status_code, dict(resp.headers), data

    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        results = await asyncio.wait_for(
            asyncio.gather(*(one(http) for _ in range(burst))), timeout=240
        )
    statuses = [status for status, _, _ in results]
    # "waiting" counts requests without a first token yet, so a burst admits at least one
    assert statuses.count(200) >= 1, statuses
    rejected = [(h, d) for s, h, d in results if s == 429]
    assert rejected, statuses
    headers, data = rejected[0]
    assert int(headers["retry-after"]) >= 1
    assert json.loads(data)["error"]["type"] == "rate_limit_error"
    assert_still_serves(server)
