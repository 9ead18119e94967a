"""What a vLLM user relies on from day one (issue 16), through real clients against one server
started with vLLM's flags: several served names, CORS, a generation_config.json of its own,
the request log. Tests that kill an actor run last: the others need a healthy engine."""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MAX_MODEL_LEN, openai_client, server_args
from tests.e2e.harness import Server, served, wait_until
from tests.holds import HOLD_TEXT, hold_env

NAMES = ("parity-a", "parity-b")
ALLOWED_ORIGIN = "https://app.example"
DEFAULT_MAX_TOKENS = 3  # the server's generation_config.json max_new_tokens
MAX_LOG_LEN = 12
# A chat template of the server's own (--chat-template, inline): each message as <<content>>
TEMPLATE = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
# Held (tests/holds.py): in flight for 20 s on any machine, so still running when a test acts.
LONG_STREAM = {
    "prompt": "a long story" + HOLD_TEXT,
    "max_tokens": 1000,
    "ignore_eos": True,
    "stream": True,
}


@pytest.fixture(scope="module")
def parity(model_args: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("parity")
    defaults = work / "genconfig"
    defaults.mkdir()
    (defaults / "generation_config.json").write_text(
        json.dumps({"max_new_tokens": DEFAULT_MAX_TOKENS})
    )
    args = server_args(
        model_args,
        work / "admin.sock",
        "--served-model-name",
        *NAMES,
        "--allowed-origins",
        json.dumps([ALLOWED_ORIGIN]),
        "--generation-config",
        str(defaults),
        "--enable-log-requests",
        "--max-log-len",
        str(MAX_LOG_LEN),
        "--enforce-eager",
        "--max-logprobs",
        "5",
        "--chat-template",
        TEMPLATE,
    )
    with served(args, work, hold_env(), name="parity") as srv:
        yield srv


@pytest.fixture
def client(parity: Server) -> Iterator[openai.OpenAI]:
    with openai_client(parity, timeout=60.0) as c:
        yield c


def sse_chunks(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200, resp.read()
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# ---------------------------------------------------------------- names, tokens, usage


def test_every_served_name_is_listed_and_usable(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == list(NAMES)
    for name in NAMES:
        resp = client.completions.create(model=name, prompt="hi", max_tokens=2)
        assert resp.model == name and resp.usage.completion_tokens >= 1
    with pytest.raises(openai.NotFoundError, match="parity-a"):
        client.completions.create(model="other", prompt="hi", max_tokens=1)


def test_tokenize_detokenize_round_trip_agrees_with_generation(
    parity: Server, client: openai.OpenAI
) -> None:
    text = "The quick brown fox jumps over the lazy dog"
    with parity.http() as http:
        tokenized = http.post("/tokenize", json={"model": NAMES[0], "prompt": text}).json()
        back = http.post("/detokenize", json={"tokens": tokenized["tokens"]}).json()
        messages = [{"role": "user", "content": text}]
        chat_tokens = http.post("/tokenize", json={"messages": messages}).json()
        rendered = http.post("/detokenize", json={"tokens": chat_tokens["tokens"]}).json()
        bad = http.post("/detokenize", json={"tokens": [10**9]})
    assert back == {"prompt": text}
    assert rendered == {"prompt": f"<<{text}>>"}  # the server's --chat-template
    assert tokenized["count"] == len(tokenized["tokens"]) > 0
    assert tokenized["max_model_len"] == MAX_MODEL_LEN
    resp = client.completions.create(
        model=NAMES[0], prompt=text, max_tokens=1, extra_body={"return_token_ids": True}
    )
    assert resp.usage.prompt_tokens == tokenized["count"]
    assert resp.choices[0].model_extra["prompt_token_ids"] == tokenized["tokens"]
    chat = client.chat.completions.create(model=NAMES[0], messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == chat_tokens["count"]
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[0]"


def test_usage_only_where_asked(parity: Server) -> None:
    body = {"prompt": "count", "max_tokens": 4, "ignore_eos": True, "stream": True}
    with parity.http() as http:
        plain = sse_chunks(http, "/v1/completions", body)
        asked = sse_chunks(
            http, "/v1/completions", {**body, "stream_options": {"include_usage": True}}
        )
        chat = sse_chunks(
            http,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
        )
    assert plain and all("usage" not in chunk for chunk in plain + chat)
    assert all("usage" not in chunk for chunk in asked[:-1])
    assert asked[-1]["choices"] == [] and asked[-1]["usage"]["completion_tokens"] == 4


def test_generation_config_defaults_apply_unless_the_request_sets_them(
    client: openai.OpenAI,
) -> None:
    default = client.completions.create(
        model=NAMES[0], prompt="defaults", extra_body={"ignore_eos": True}
    )
    own = client.completions.create(
        model=NAMES[0], prompt="defaults", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert default.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert own.usage.completion_tokens == 5


def test_stop_reason_names_the_stop_token_or_string(client: openai.OpenAI) -> None:
    base = {"model": NAMES[0], "prompt": "stop reasons", "max_tokens": 8, "temperature": 0.0}
    first = client.completions.create(
        **base, extra_body={"ignore_eos": True, "return_token_ids": True}
    ).choices[0]
    assert first.finish_reason == "length" and first.model_extra["stop_reason"] is None
    token_ids = first.model_extra["token_ids"]
    assert len(token_ids) == 8
    by_token = client.completions.create(
        **base, extra_body={"ignore_eos": True, "stop_token_ids": [token_ids[3]]}
    ).choices[0]
    assert by_token.finish_reason == "stop"
    assert by_token.model_extra["stop_reason"] == token_ids[3]
    stop = first.text[len(first.text) // 2 :][:2]
    assert stop, first.text
    by_string = client.completions.create(
        **base, stop=[stop], extra_body={"ignore_eos": True}
    ).choices[0]
    assert by_string.finish_reason == "stop" and by_string.model_extra["stop_reason"] == stop


def test_cached_tokens_count_prefix_cache_hits(client: openai.OpenAI) -> None:
    prompt = " ".join(f"cached{i}" for i in range(60))  # many blocks of 16 tokens

    def cached() -> int:
        resp = client.completions.create(model=NAMES[0], prompt=prompt, max_tokens=1)
        return int(resp.usage.prompt_tokens_details.cached_tokens)

    assert cached() == 0
    assert cached() >= 16


def test_return_token_ids_in_streams_and_chat(parity: Server, client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "ids please"}]
    chat = client.chat.completions.create(
        model=NAMES[1],
        messages=messages,
        max_tokens=4,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert len(chat.choices[0].model_extra["token_ids"]) == chat.usage.completion_tokens == 4
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    body = {
        "messages": messages,
        "max_tokens": 4,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    with parity.http() as http:
        chunks = sse_chunks(http, "/v1/chat/completions", body)
    streamed = [t for chunk in chunks for c in chunk["choices"] for t in c.get("token_ids", [])]
    assert len(streamed) == 4
    assert sum("prompt_token_ids" in chunk for chunk in chunks) == 1
    plain = client.completions.create(model=NAMES[0], prompt="x", max_tokens=1)
    assert "token_ids" not in plain.choices[0].model_extra


def test_echo_scores_the_prompt_as_transformers_does(parity: Server, client: openai.OpenAI) -> None:
    """lm-eval-harness's loglikelihood request: echo, logprobs and max_tokens 0."""
    import torch

    from tests.checkpoints import tiny_checkpoint
    from tests.hf_reference import hf_logits

    prompt = "the cat sat on the mat and looked at the dog"
    scored = client.completions.create(
        model=NAMES[0], prompt=prompt, echo=True, logprobs=2, max_tokens=0
    )
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage is not None
    assert scored.usage.completion_tokens == 0 and choice.finish_reason == "length"
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == scored.usage.prompt_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs is not None
    with parity.http() as http:
        ids = http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]
    reference = torch.log_softmax(hf_logits(tiny_checkpoint(), ids), dim=-1)
    for position in range(1, len(ids)):
        expected = float(reference[position - 1, ids[position]])
        assert abs(logprobs.token_logprobs[position] - expected) < 1e-4
        assert len(logprobs.top_logprobs[position]) >= 2


def test_echo_puts_the_prompt_before_the_completion_whole_and_streamed(
    client: openai.OpenAI,
) -> None:
    prompt = "once upon a time"
    whole = client.completions.create(
        model=NAMES[0], prompt=prompt, echo=True, logprobs=1, max_tokens=4, temperature=0
    )
    choice = whole.choices[0]
    assert whole.usage is not None and whole.usage.completion_tokens == 4
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert len(choice.logprobs.token_logprobs) == whole.usage.prompt_tokens + 4
    streamed = client.completions.create(
        model=NAMES[0], prompt=prompt, echo=True, max_tokens=4, temperature=0, stream=True
    )
    texts = [c.choices[0].text for c in streamed if c.choices]
    assert texts[0].startswith(prompt) and "".join(texts) == choice.text


def test_prompt_logprobs_in_vllms_shape(parity: Server) -> None:
    body = {"model": NAMES[0], "prompt": "a b c d e", "max_tokens": 1, "prompt_logprobs": 2}
    with parity.http() as http:
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
        prompt = http.post("/tokenize", json={"prompt": "a b c d e"}).json()["tokens"]
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(prompt) and scores[0] is None
    for token_id, entry in zip(prompt[1:], scores[1:], strict=True):
        assert str(token_id) in entry and len(entry) in (2, 3)  # the token, and the top 2
        assert sorted(e["rank"] for e in entry.values() if e["rank"] is not None) == [1, 2]


def test_out_of_range_scoring_fields_are_refused_by_name(parity: Server) -> None:
    with parity.http() as http:
        for field, value in (("max_tokens", 0), ("prompt_logprobs", 21), ("logprobs", 6)):
            body = {"prompt": "x", "max_tokens": 1, field: value}
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 400, (field, resp.text)
            assert resp.json()["error"]["param"] == field


# ---------------------------------------------------------------- operations


def test_client_request_id_is_echoed_and_logged(parity: Server) -> None:
    with parity.http() as http:
        by_header = http.post(
            "/v1/completions",
            json={"prompt": "a prompt longer than the log shows", "max_tokens": 1},
            headers={"X-Request-Id": "header-id-1"},
        )
        by_body = http.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "request_id": "body-id-1",
            },
        )
    assert by_header.headers["x-request-id"] == "header-id-1"
    assert by_header.json()["id"] == "cmpl-header-id-1"
    assert by_body.headers["x-request-id"] == "body-id-1"
    line = wait_until(
        lambda: next((x for x in parity.log().splitlines() if "request header-id-1:" in x), None)
    )
    assert "prompt_tokens=" in line and "outcome=success" in line and "ttft=" in line
    assert "prompt='a prompt lon...'" in line  # cut at --max-log-len characters


def _abort_mid_stream(parity: Server, request_id: str, abort: Any) -> list[dict[str, Any]]:
    with (
        parity.http() as http,
        http.stream(
            "POST", "/v1/completions", json=LONG_STREAM, headers={"X-Request-Id": request_id}
        ) as resp,
    ):
        assert resp.headers["x-request-id"] == request_id
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        duplicate = http.post(
            "/v1/completions",
            json={"prompt": "x", "max_tokens": 1},
            headers={"X-Request-Id": request_id},
        )
        assert duplicate.status_code == 400 and duplicate.json()["error"]["param"] == "X-Request-Id"
        abort(request_id)
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    return [json.loads(x) for x in rest[:-1]]


def test_abort_by_client_request_id_over_http_and_admin_socket(parity: Server) -> None:
    def over_http(request_id: str) -> None:
        with parity.http() as http:
            resp = http.post("/abort", json={"request_id": request_id})
        assert resp.status_code == 200 and resp.json() == {"aborted": request_id}

    def over_admin(request_id: str) -> None:
        assert parity.admin("abort", request_id) == {"aborted": request_id}

    for request_id, abort in (("abort-http-1", over_http), ("abort-admin-1", over_admin)):
        chunks = _abort_mid_stream(parity, request_id, abort)
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert len(chunks) < LONG_STREAM["max_tokens"]
    with parity.http() as http:
        unknown = http.post("/abort", json={"request_id": "nobody"})
        no_key = httpx.post(parity.url + "/abort", json={"request_id": "nobody"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "request_id"
    assert no_key.status_code == 401


def test_abort_by_client_id_ends_every_prompt_of_a_batched_request(parity: Server) -> None:
    def over_http(request_id: str) -> None:
        with parity.http() as http:
            assert http.post("/abort", json={"request_id": request_id}).status_code == 200

    body = {**LONG_STREAM, "prompt": ["one story" + HOLD_TEXT, "another story" + HOLD_TEXT]}
    with (
        parity.http() as http,
        http.stream("POST", "/v1/completions", json=body, headers={"X-Request-Id": "b-1"}) as resp,
    ):
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        over_http("b-1")
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    finish = {c["index"]: c["finish_reason"] for chunk in chunks for c in chunk["choices"]}
    assert {i: finish.get(i) for i in (0, 1)} == {0: "abort", 1: "abort"}


def test_cors_preflight_allows_only_the_allowed_origin(parity: Server) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(
            parity.url + "/v1/chat/completions",
            headers={
                "Origin": origin,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type",
            },
        )

    allowed = preflight(ALLOWED_ORIGIN)
    refused = preflight("https://evil.example")
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    assert refused.status_code == 400
    assert "access-control-allow-origin" not in refused.headers


def test_metrics_have_vllms_names_and_labels(parity: Server, client: openai.OpenAI) -> None:
    client.completions.create(model=NAMES[0], prompt="metrics", max_tokens=3)
    with parity.http() as http:
        # Ring traffic arrives with heartbeats (one a second): wait for rank 0's results.
        def scraped_with_results() -> str | None:
            text = http.get("/metrics").text
            return text if 'ring="results"' in text else None

        text = wait_until(scraped_with_results, 10)
    samples: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample.labels)
    histograms = (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    )
    expected = [
        "engine:num_requests_running",
        "engine:num_requests_waiting",
        "engine:kv_cache_usage_perc",
        "engine:prefix_cache_queries_total",
        "engine:prefix_cache_hits_total",
        "engine:num_preemptions_total",
        "engine:prompt_tokens_total",
        "engine:generation_tokens_total",
        "engine:request_success_total",
        "engine:actor_restarts_total",
        "engine:request_resubmissions_total",
        "engine:http_requests_total",
        "engine:ring_frames_sent_total",
        "engine:ring_bytes_sent_total",
        *(f"engine:{name}_count" for name in histograms),
        *(f"engine:{name}_bucket" for name in histograms),
    ]
    for name in expected:
        assert name in samples, name
        assert all(labels.get("model_name") == NAMES[0] for labels in samples[name]), name
    reasons = {labels["finished_reason"] for labels in samples["engine:request_success_total"]}
    assert "length" in reasons
    assert {labels["actor"] for labels in samples["engine:actor_restarts_total"]} >= {"tokenizer"}
    # Ring traffic by sender and ring: the scheduler's plans, rank 0's results, the detokenizer's
    # outputs, each counted in frames and bytes.
    traffic = {
        (labels["actor"], labels["ring"]) for labels in samples["engine:ring_bytes_sent_total"]
    }
    assert {("scheduler", "plan"), ("worker0", "results")} <= traffic, traffic


def test_stats_line_is_logged_periodically(parity: Server) -> None:
    wait_until(lambda: "generation throughput" in parity.log(), timeout=40)


# ---------------------------------------------------------------- probes (kills an actor: last)


def test_liveness_stays_up_while_an_actor_restarts_and_readiness_follows(
    parity: Server,
) -> None:
    seen: dict[str, set[int]] = {"health": set(), "ready": set()}
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=parity.url, timeout=10) as http:
            while not stop.is_set():
                seen["health"].add(http.get("/health").status_code)
                seen["ready"].add(http.get("/ready").status_code)

    with parity.http() as http:
        assert http.get("/ready").status_code == 200
    (tokenizer,) = [a for a in parity.admin("actors") if a["name"] == "tokenizer"]
    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    try:
        os.kill(tokenizer["pid"], signal.SIGKILL)  # a child of the server this module started
        wait_until(lambda: 503 in seen["ready"], timeout=60, interval=0.01)

        def restarted() -> bool:
            (row,) = [a for a in parity.admin("actors") if a["name"] == "tokenizer"]
            return bool(row["restarts"] >= 1 and row["state"] == "running")

        wait_until(restarted, timeout=120)
        with parity.http() as http:
            wait_until(lambda: http.get("/ready").status_code == 200, timeout=60)
    finally:
        stop.set()
        prober.join(30)
    assert seen["health"] == {200}
    assert seen["ready"] == {200, 503}
