"""Tenants in a real server (issue 49): who a key is, what its tenant may ask, its quotas, and
what it can see of another tenant: cached prefixes, stored conversations, request ids, aborts.

One server with a tenants file (--api-keys-file) runs every probe; held requests (tests/holds.py)
stay in flight while a test acts on them, whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.tenants.table import key_digest
from tests.e2e.conftest import server_args, without_api_key
from tests.e2e.harness import Server, served, wait_until
from tests.holds import HOLD_TEXT, hold_env

KEYS = {name: f"sk-{name}-test-key" for name in ("alice", "bob", "carol", "dave", "frank")}
TENANTS = """
[tenants.alice]
key_sha256 = "{alice}"
weight = 3

[tenants.bob]
key_sha256 = "{bob}"
priority_ceiling = 0

[tenants.carol]
key_sha256 = "{carol}"
max_concurrent_requests = 1

[tenants.frank]
key_sha256 = "{frank}"
tokens_per_minute = 50

[tenants.dave]
key_sha256 = "{dave}"
models = ["some-other-model"]
"""
HELD = {"prompt": "a long story" + HOLD_TEXT, "max_tokens": 1000, "ignore_eos": True}


@pytest.fixture(scope="module")
def tenants_server(
    model_args: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("tenants")
    path = work / "tenants.toml"
    path.write_text(TENANTS.format(**{n: key_digest(k) for n, k in KEYS.items()}))
    path.chmod(0o600)
    args = without_api_key(server_args(model_args, work / "admin.sock"))
    with served([*args, "--api-keys-file", str(path)], work, hold_env(), name="tenants") as srv:
        srv.extra["tenants_file"] = path
        yield srv


def client(server: Server, tenant: str) -> httpx.Client:
    return server.http(api_key=KEYS[tenant], timeout=60.0)


def complete(server: Server, tenant: str, **body: Any) -> httpx.Response:
    with client(server, tenant) as http:
        return http.post("/v1/completions", json={"max_tokens": 1, **body})


def test_a_key_names_its_tenant_and_the_tenant_bounds_what_it_asks(tenants_server: Server) -> None:
    assert complete(tenants_server, "alice", prompt="hello").status_code == 200
    with httpx.Client(base_url=tenants_server.url, timeout=60.0) as anonymous:
        for key in (None, "sk-unknown"):
            headers = {} if key is None else {"Authorization": f"Bearer {key}"}
            refused = anonymous.post("/v1/completions", json={"prompt": "x"}, headers=headers)
            assert refused.status_code == 401, refused.text
    too_urgent = complete(tenants_server, "bob", prompt="x", priority=-1)
    assert too_urgent.status_code == 403 and too_urgent.json()["error"]["param"] == "priority"
    assert complete(tenants_server, "bob", prompt="x", priority=3).status_code == 200
    not_allowed = complete(tenants_server, "dave", prompt="x")
    assert not_allowed.status_code == 404 and not_allowed.json()["error"]["param"] == "model"
    with client(tenants_server, "dave") as dave:  # Ollama's API runs as the tenant too
        body = {"model": tenants_server.model, "prompt": "x", "stream": False}
        assert dave.post("/api/generate", json=body).status_code == 404
        assert dave.get("/v1/models").json()["data"] == []  # none of its models is served


def test_a_quota_answers_429_with_retry_after_in_the_apis_shape(tenants_server: Server) -> None:
    with (
        client(tenants_server, "carol") as http,
        http.stream("POST", "/v1/completions", json={**HELD, "stream": True}) as held,
    ):
        lines = held.iter_lines()  # kept: the stream stays open until the block's end
        next(line for line in lines if line.startswith("data: "))
        second = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert second.status_code == 429, second.text
        error = second.json()["error"]
        assert (error["type"], error["code"]) == ("rate_limit_error", "rate_limit_exceeded")
        assert "max_concurrent_requests 1" in error["message"]
        assert int(second.headers["retry-after"]) >= 1
        other = complete(tenants_server, "alice", prompt="x")  # other tenants are served
        assert other.status_code == 200
    # The held request was cut off by the client: it cost the tokens it generated, and its
    # tenant may send again.
    wait_until(lambda: complete(tenants_server, "carol", prompt="x").status_code == 200)
    rows = {row["name"]: row for row in tenants_server.admin("tenants")}
    assert rows["carol"]["throttled"] >= 1 and rows["carol"]["tokens_last_minute"] > 0
    metrics = dict(
        line.rsplit(" ", 1)
        for line in httpx.get(tenants_server.url + "/metrics", timeout=60.0).text.splitlines()
        if line.startswith("engine:tenant_")
    )
    throttled = 'engine:tenant_throttled_total{quota="concurrent_requests",tenant="carol"}'
    assert float(metrics[throttled]) == rows["carol"]["throttled"]
    assert float(metrics['engine:tenant_tokens_total{tenant="carol"}']) > 0
    # One that fits is served whole, past the limit; the next waits for the minute to pass.
    assert complete(tenants_server, "frank", prompt="x", max_tokens=50, ignore_eos=True)
    over = complete(tenants_server, "frank", prompt="x")
    assert over.status_code == 429 and "tokens_per_minute 50" in over.json()["error"]["message"]
    assert 1 < int(over.headers["retry-after"]) <= 60
    with client(tenants_server, "frank") as frank:  # in Ollama's shape on its API
        body = {"model": tenants_server.model, "prompt": "x", "stream": False}
        ollama = frank.post("/api/generate", json=body)
    assert ollama.status_code == 429 and "tokens_per_minute 50" in ollama.json()["error"]
    assert int(ollama.headers["retry-after"]) > 1


def test_the_prefix_cache_is_never_shared_across_tenants(tenants_server: Server) -> None:
    prompt = " ".join(f"secret{i}" for i in range(60))  # many blocks of 16 tokens

    def cached(tenant: str, **body: Any) -> int:
        resp = complete(tenants_server, tenant, prompt=prompt, **body)
        return int(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached("alice") == 0
    assert cached("bob") == 0  # a right guess tells another tenant nothing
    assert cached("bob", cache_salt="s1") == 0  # nor another salt of its own
    assert cached("alice") >= 16 * 5  # the full hit within one tenant


def test_conversations_request_ids_and_aborts_are_the_tenants_own(tenants_server: Server) -> None:
    with client(tenants_server, "alice") as alice, client(tenants_server, "bob") as bob:
        body = {"model": tenants_server.model, "input": "hi", "max_output_tokens": 2}
        first = alice.post("/v1/responses", json=body).json()
        follow = {**body, "previous_response_id": first["id"]}
        unknown = bob.post("/v1/responses", json=follow)  # as for an id never given out
        assert unknown.status_code == 404
        assert unknown.json()["error"]["param"] == "previous_response_id"
        assert alice.post("/v1/responses", json=follow).status_code == 200
        stored = f"/v1/responses/{first['id']}"
        assert bob.get(stored).status_code == 404 and bob.delete(stored).status_code == 404
        assert alice.get(stored).json()["id"] == first["id"]
        with alice.stream(
            "POST", "/v1/completions", json={**HELD, "stream": True}, headers={"X-Request-Id": "r1"}
        ) as held:
            lines = held.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            # Bob's own "r1" is his: neither in flight for him, nor a way to reach Alice's.
            assert complete(tenants_server, "bob", prompt="x", request_id="r1").status_code == 200
            assert bob.post("/abort", json={"request_id": "r1"}).status_code == 404
            assert alice.post("/abort", json={"request_id": "r1"}).status_code == 200
            chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"


def test_the_tenants_file_is_reloaded_on_sighup_and_by_the_admin_socket(
    tenants_server: Server,
) -> None:
    path: Path = tenants_server.extra["tenants_file"]
    original = path.read_text()
    try:
        path.write_text(original + f'\n[tenants.erin]\nkey_sha256 = "{key_digest("sk-erin")}"\n')
        os.kill(tenants_server.proc.pid, signal.SIGHUP)
        with httpx.Client(base_url=tenants_server.url, timeout=60.0) as http:
            headers = {"Authorization": "Bearer sk-erin"}

            def erin_served() -> bool:
                body = {"prompt": "x", "max_tokens": 1}
                return http.post("/v1/completions", json=body, headers=headers).status_code == 200

            wait_until(erin_served)
        path.write_text("[tenants\n")  # broken: the admin socket says so, the old ones stay
        reply = tenants_server.admin_reply("reload-tenants")
        assert not reply["ok"] and "not valid TOML" in reply["error"]
        assert complete(tenants_server, "alice", prompt="x").status_code == 200
    finally:
        path.write_text(original)
        tenants_server.admin("reload-tenants")
