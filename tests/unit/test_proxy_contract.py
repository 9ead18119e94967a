"""The P/D contract's bodies (proxy side) and `engine proxy`'s command line."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from starlette.requests import Request

from engine.cli.proxy_cmd import ProxyUsageError, parse_proxy_args
from engine.proxy.client_side import upstream_headers
from engine.proxy.pd import decode_body, kv_transfer_params_of, prefill_body
from tests.e2e.harness import REPO
from tests.fresh_process import imported_after

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_completion_tokens": 40,
    "temperature": 0.7,
    "seed": 3,
    "logprobs": True,
    "top_logprobs": 2,
    "stop": ["\n"],
    "kv_transfer_params": {"from": "the client"},
}


def test_the_prefill_asks_one_unstreamed_token_and_the_kv_for_a_decode_instance() -> None:
    sent = json.loads(prefill_body(CHAT))
    assert sent["stream"] is False
    assert "stream_options" not in sent
    assert sent["max_tokens"] == 1
    assert sent["max_completion_tokens"] == 1
    assert sent["kv_transfer_params"] == {"do_remote_decode": True}
    untouched = {"stream", "stream_options", "max_tokens", "max_completion_tokens"}
    untouched.add("kv_transfer_params")
    assert {k: v for k, v in sent.items() if k not in untouched} == {
        k: v for k, v in CHAT.items() if k not in untouched
    }


def test_a_completion_prefill_adds_no_max_completion_tokens() -> None:
    sent = json.loads(prefill_body({"model": "m", "prompt": "x", "max_tokens": 9}))
    assert sent["max_tokens"] == 1
    assert "max_completion_tokens" not in sent


def test_the_decode_instance_gets_every_client_field_plus_the_prefills_params() -> None:
    params = {"remote_host": "10.0.0.1", "remote_block_ids": [1, 2], "transfer_id": "x-0"}
    sent = json.loads(decode_body(CHAT, params))
    assert sent == {**CHAT, "kv_transfer_params": params}
    without = json.loads(decode_body(CHAT, None))
    assert without == {k: v for k, v in CHAT.items() if k != "kv_transfer_params"}


@pytest.mark.parametrize(
    ("answer", "params"),
    [
        (b'{"id": "x", "kv_transfer_params": {"a": 1}}', {"a": 1}),
        (b'{"id": "x", "kv_transfer_params": null}', None),
        (b'{"id": "x"}', None),
        (b"not json", None),
    ],
)
def test_transfer_params_are_read_from_the_prefills_answer(
    answer: bytes, params: dict[str, int] | None
) -> None:
    assert kv_transfer_params_of(answer) == params


def test_transfer_params_that_are_not_an_object_are_refused() -> None:
    """A decode instance takes an object only: an array would come back as a 400."""
    with pytest.raises(ValueError, match="kv_transfer_params is a JSON list, not an object"):
        kv_transfer_params_of(b'{"kv_transfer_params": ["req@0", [1, 2]]}')


def test_good_arguments_make_a_config() -> None:
    config = parse_proxy_args(
        ["--prefill", "http://a:1/", "https://b:2", "--decode", "http://c:3", "--port", "0"]
    )
    assert config.prefill == ("http://a:1", "https://b:2")
    assert config.decode == ("http://c:3",)
    assert config.port == 0
    assert config.host == "127.0.0.1"
    assert (config.connect_timeout, config.first_byte_timeout) == (2.0, 30.0)
    assert (config.probe_interval, config.probe_timeout, config.probe_failures) == (1.0, 1.0, 3)
    tuned = parse_proxy_args(
        [
            *("--prefill", "http://a:1", "--decode", "http://c:3"),
            *("--first-byte-timeout", "5", "--read-timeout", "20", "--probe-failures", "2"),
        ]
    )
    assert (tuned.first_byte_timeout, tuned.read_timeout, tuned.probe_failures) == (5.0, 20.0, 2)


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--decode", "http://c:3"], "no prefill instance"),
        (["--prefill", "http://a:1"], "no decode instance"),
        (["--prefill", "a:1", "--decode", "http://c:3"], "'a:1'"),
        (["--prefill", "http://a:1", "--decode", "ftp://c:3"], "'ftp://c:3'"),
        (["--prefill", "http://a:x", "--decode", "http://c:3"], "the port"),
        (["--prefill", "http://a:1", "http://a:1/", "--decode", "http://c:3"], "more than once"),
        (["--prefill", "http://a:1", "--decode", "http://c:3", "--port", "70000"], "--port"),
        (["--prefill", "http://a:1", "--decode", "http://c:3", "--read-timeout", "0"], "read"),
        (
            ["--prefill", "http://a:1", "--decode", "http://c:3", "--first-byte-timeout", "0"],
            "first",
        ),
        (["--prefill", "http://a:1", "--decode", "http://c:3", "--probe-failures", "0"], "probe"),
        (["--prefill", "http://a:1", "--decode", "http://c:3", "--bogus"], "--bogus"),
    ],
)
def test_bad_arguments_are_named(argv: list[str], named: str) -> None:
    with pytest.raises(ProxyUsageError, match=named):
        parse_proxy_args(argv)


def run_proxy(*argv: str) -> tuple[int, str]:
    """`python -m engine proxy ARGV` run to its end: its exit status and its one stderr line."""
    done = subprocess.run(
        [sys.executable, "-m", "engine", "proxy", *argv],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return done.returncode, lines[0]


def test_the_command_exits_nonzero_with_one_line() -> None:
    status, line = run_proxy("--prefill", "localhost:8000")
    assert status == 2
    assert "localhost:8000" in line


def test_the_proxy_imports_no_model_code() -> None:
    """It starts in well under a second: torch and transformers stay out of it."""
    code = "import engine.cli.proxy_cmd, engine.proxy.server"
    assert imported_after(code, ("torch", "transformers", "engine.library.async_llm")) == []


def test_a_busy_port_is_one_line_and_status_1() -> None:
    nowhere = "http://127.0.0.1:9"
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        status, line = run_proxy("--prefill", nowhere, "--decode", nowhere, "--port", str(port))
    assert status == 1
    assert "cannot listen on" in line and f"127.0.0.1:{port}" in line


def test_the_instances_see_the_clients_trace_context_and_key_but_not_its_hop_headers() -> None:
    """A W3C trace context crosses the proxy, so an instance's request span continues the
    client's trace; host, lengths and hop-by-hop headers are the proxy's own."""
    sent = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "vendor=1",
        "authorization": "Bearer k",
        "host": "proxy:8000",
        "content-length": "12",
        "connection": "keep-alive",
    }
    scope = {"type": "http", "headers": [(k.encode(), v.encode()) for k, v in sent.items()]}
    passed = upstream_headers(Request(scope))
    for name in ("traceparent", "tracestate", "authorization"):
        assert passed[name] == sent[name]
    assert not {"host", "content-length", "connection"} & set(passed)
    assert passed["x-request-id"]  # one id for the prefill and the decode instance
