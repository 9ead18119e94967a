"""The server and the P/D proxy guard their clients alike (engine/http/guards.py): the same
refusal, status and words for a missing, wrong or non-ASCII API key and for a body over the
limit; each in its own error shape. Both real apps, in process: every request here is refused
before an engine or an instance is needed."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from engine.http.app import build_app
from engine.http.state import ServerState
from engine.library.llm import build_settings
from engine.proxy.app import build_proxy_app
from engine.proxy.config import ProxyConfig
from engine.proxy.metrics import ProxyMetrics
from engine.proxy.pool import Instance, InstancePool, Role

KEY = "sesame"
LIMIT = 64
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def fronts() -> Iterator[dict[str, TestClient]]:
    settings = build_settings(**{"server.api_key": KEY, "server.max_request_bytes": LIMIT})
    server = build_app(ServerState.create(settings))
    config = ProxyConfig(
        prefill=("http://127.0.0.1:9",),
        decode=("http://127.0.0.1:9",),
        api_key=KEY,
        max_request_bytes=LIMIT,
    )
    pool = InstancePool([Instance(url, Role.PREFILL) for url in config.prefill])
    proxy = build_proxy_app(pool, httpx.AsyncClient(), ProxyMetrics(pool), config)
    with TestClient(server) as on_server, TestClient(proxy) as on_proxy:
        yield {"server": on_server, "proxy": on_proxy}


def refusals(fronts: dict[str, TestClient], **request: Any) -> list[tuple[Any, ...]]:
    """(status, message, type, WWW-Authenticate) of the same request to the server and the
    proxy."""
    out = []
    for client in fronts.values():
        answer = client.post("/v1/completions", **request)
        error = answer.json()["error"]
        auth = answer.headers.get("www-authenticate")
        out.append((answer.status_code, error["message"], error["type"], auth))
    return out


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({}, 401),
        ({"Authorization": "Bearer wrong"}, 401),
        ({"Authorization": "Basic " + KEY}, 401),
        ({"Authorization": "Bearer s\xe9same".encode("latin-1")}, 400),
    ],
)
def test_an_api_key_is_refused_alike(
    fronts: dict[str, TestClient], headers: dict[str, Any], status: int
) -> None:
    on_server, on_proxy = refusals(fronts, json=COMPLETION, headers=headers)
    assert on_server == on_proxy
    assert on_server[0] == status
    if status == 400:
        assert "non-ASCII" in on_server[1]


def test_a_body_over_the_limit_is_refused_alike(fronts: dict[str, TestClient]) -> None:
    body = {"prompt": "x" * LIMIT, "max_tokens": 2}
    on_server, on_proxy = refusals(fronts, json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert on_server[0] == on_proxy[0] == 413
    # Each names where its limit is set: server.max_request_bytes, the proxy's flag.
    words = f"bytes is over the limit of {LIMIT} bytes"
    assert words in on_server[1] and words in on_proxy[1]
    assert on_server[1].split("(")[0] == on_proxy[1].split("(")[0]
