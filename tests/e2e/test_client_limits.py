"""A careless or hostile client cannot take the server down: requests that ask for too much are
refused with 400 naming the limit, huge prompts do not stall the tokenizer's heart, a client
that stops reading has its request aborted, and chat contents cannot forge control tokens.
After each, no actor has restarted and the next normal request is served."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from engine.text.hf_tokenizer import load_tokenizer_without_torch
from tests.e2e.conftest import MAX_QUEUED, server_args
from tests.e2e.harness import API_KEY, Server, served, wait_until
from tests.e2e.test_bad_input import assert_still_serves, error_of
from tests.holds import HOLD_TEXT, hold_env

AUTH = {"Authorization": f"Bearer {API_KEY}"}
STALLED_STREAM_TIMEOUT_S = 2


def restarts(server: Server) -> dict[str, int]:
    return {actor["name"]: actor["restarts"] for actor in server.admin("actors")}


@pytest.fixture
def unchanged_restarts(server: Server) -> Iterator[None]:
    before = restarts(server)
    yield
    assert restarts(server) == before


@pytest.mark.parametrize(
    ("body", "param", "named"),
    [
        ({"n": 20000, "max_tokens": 1}, "n", "limits.max_n"),
        ({"n": 2**31 - 1, "max_tokens": 1}, "n", "limits.max_n"),  # nothing built per sample
        ({"n": MAX_QUEUED + 1, "max_tokens": 1}, "n", "max_queued_samples"),
        ({"stop": [f"s{i}" for i in range(100)]}, "stop", "limits.max_stop_strings"),
        ({"stop": ["x" * 5000, "y" * 5000]}, "stop", "limits.max_stop_chars"),
    ],
)
def test_requests_over_a_limit_get_400_naming_it(
    server: Server, unchanged_restarts: None, body: dict[str, Any], param: str, named: str
) -> None:
    with server.http() as http:
        resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, **body})
    error = error_of(resp, 400)
    assert error["param"] == param and named in error["message"]
    assert_still_serves(server)


def test_chat_content_cannot_write_control_tokens(
    server: Server, unchanged_restarts: None, model_args: list[str]
) -> None:
    tokenizer = load_tokenizer_without_torch(model_args[1])
    literal = "<|im_end|>"

    def prompt_tokens(content: str) -> int:
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 1}
        with server.http() as http:
            resp = http.post("/v1/chat/completions", json=body)
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["prompt_tokens"])

    as_text = tokenizer.encode(literal, add_special_tokens=False, split_special_tokens=True)
    assert len(as_text) > 1
    # The content costs what its characters cost as text, not one control token.
    assert prompt_tokens(f"a{literal}") - prompt_tokens("a") == len(as_text)


@pytest.mark.parametrize(
    ("template", "bound"),
    [
        ("{{ (9**(4782969*5)) % 7 }}", "integer power"),  # held the root's GIL for 22 s
        (
            "{% for a in range(30000) %}{% for b in range(30000) %}{% endfor %}{% endfor %}",
            "CPU seconds",
        ),
        # rendered 30 M characters and grew the root by 6 GiB
        (
            "{% for a in messages * 9999 %}{% for b in messages * 9999 %}x{% endfor %}{% endfor %}",
            "characters",
        ),
    ],
    ids=["power", "loop", "output"],
)
def test_a_clients_chat_template_is_bounded_and_rendered_off_the_root(
    server: Server, template: str, bound: str
) -> None:
    """/tokenize renders the client's `chat_template` (the client's code) in a tokenizer actor
    within its bounds: refused with 400 naming the bound, while /health answers throughout."""
    body = {"messages": [{"role": "user", "content": "hi"}], "chat_template": template}
    with server.http() as http, server.http() as probe:
        answer: list[httpx.Response] = []
        render = threading.Thread(target=lambda: answer.append(http.post("/tokenize", json=body)))
        render.start()
        healthy = []
        while render.is_alive():  # the root's event loop serves everyone meanwhile
            healthy.append(probe.get("/health", timeout=5).status_code)
        render.join()
    error = error_of(answer[0], 400)
    assert error["param"] == "chat_template" and bound in error["message"], error
    assert set(healthy) <= {200}
    assert_still_serves(server)


@pytest.fixture(scope="module")
def roomy_server(
    model_args: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """Big bodies allowed, prompt text checked only after tokenizing (so a megabyte prompt is
    tokenized), a tokenizer declared hung after 1.5 s without a heartbeat, small stream buffers
    and a short stalled-stream timeout, and limits that let 3 MB of stop strings through (so
    that what carries them between actors is what gets tested)."""
    work = tmp_path_factory.mktemp("roomy")
    extra = [
        "--max-request-bytes",
        "8MiB",
        "--max-queued-samples",
        "64",
        "--limits.max_prompt_chars_per_token",
        "4096",
        "--runtime.heartbeat_interval",
        "0.25",
        "--runtime.heartbeat_timeout",
        "1.5",
        "--server.stream_buffer",
        "4",
        "--server.stalled_stream_timeout",
        str(STALLED_STREAM_TIMEOUT_S),
        "--limits.max_stop_strings",
        "30000",
        "--limits.max_stop_chars",
        "4000000",
    ]
    args = server_args(model_args, work / "admin.sock", *extra)
    with served(args, work, hold_env(), name="roomy") as srv:
        yield srv


def test_prompt_text_that_could_never_fit_is_refused_before_tokenizing(server: Server) -> None:
    with server.http() as http:
        resp = http.post("/v1/completions", json={"prompt": "word " * 10_000, "max_tokens": 2})
    error = error_of(resp, 400)
    assert error["param"] == "prompt" and "max_prompt_chars_per_token" in error["message"]


def test_a_megabyte_prompt_tokenizes_without_stalling_the_tokenizer(roomy_server: Server) -> None:
    before = restarts(roomy_server)
    huge = {"prompt": "the quick brown fox. " * 100_000, "max_tokens": 2}  # 2 MB, ~2 s to tokenize
    order: list[str] = []

    def post(name: str, body: dict[str, Any]) -> httpx.Response:
        with roomy_server.http(timeout=120) as http:
            resp = http.post("/v1/completions", json=body)
        order.append(name)
        return resp

    results: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: results.__setitem__("huge", post("huge", huge)))
    thread.start()
    wait_until(lambda: roomy_server.admin("requests"), timeout=30)  # the huge one is in
    results["small"] = post("small", {"prompt": "hello", "max_tokens": 2})
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert results["small"].status_code == 200, results["small"].text
    assert order[0] == "small"  # served while the huge prompt was still being tokenized
    error = error_of(results["huge"], 400)  # far more tokens than max_model_len
    assert error["param"] == "prompt"
    assert restarts(roomy_server) == before


def test_a_client_that_stops_reading_has_its_request_aborted(roomy_server: Server) -> None:
    """The request stops generating and frees its KV once its client has left the stream unread
    for the stalled-stream timeout, on any host. Its ~6 MB of events (20 logprobs a token) are
    many times what the server's fixed send buffer (server.send_buffer, 256 KiB) and this
    client's 4 KiB receive buffer hold; before the buffer was fixed, the kernel's autotuning
    held 2.8 MB of it, and on some hosts the whole output fitted and ran to its end unread.
    Held (tests/holds.py), the request would run 20 s on any host if nothing stopped it."""
    before = restarts(roomy_server)
    samples, max_tokens = 8, 1000
    body = json.dumps(
        {
            "prompt": "hi" + HOLD_TEXT,
            "stream": True,
            "n": samples,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "logprobs": 20,
        }
    ).encode()
    host, port = httpx.URL(roomy_server.url).host, httpx.URL(roomy_server.url).port
    generated = 0  # the most tokens the request was seen to have, all samples together

    def aborted() -> bool:
        nonlocal generated
        rows = roomy_server.admin("requests")
        generated = max([generated, *(row["generated_tokens"] for row in rows)])
        return bool(roomy_server.admin("stats")["stalled_stream_aborts"] >= 1)

    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a reader that never reads
        sock.settimeout(30)
        sock.connect((host, port))
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        wait_until(aborted, timeout=STALLED_STREAM_TIMEOUT_S + 30)
        stats = wait_until(lambda: (s := roomy_server.admin("stats"))["kv_usage"] == 0 and s, 30)
        assert not roomy_server.admin("requests")
        assert stats["stalled_stream_aborts"] == 1
    assert generated < samples * max_tokens  # stopped early, not run to its end unread
    assert restarts(roomy_server) == before
    assert_still_serves(roomy_server)


def test_megabytes_of_stop_strings_with_several_samples_are_served_not_a_crash(
    roomy_server: Server,
) -> None:
    # The hostile client's repro: 3 MB of stop strings, n=3, three times. They once went into
    # every step plan once per sample (9.4 MB on an 8 MB ring): the scheduler crash-looped.
    before = restarts(roomy_server)
    stops = ["x" * 150 + str(i) for i in range(20000)]
    body = {"prompt": "a", "max_tokens": 2, "n": 3, "stop": stops}
    with roomy_server.http(timeout=120) as http:
        for _ in range(3):
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert len(resp.json()["choices"]) == 3
    assert restarts(roomy_server) == before
    assert_still_serves(roomy_server)
