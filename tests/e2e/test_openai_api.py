"""The OpenAI-compatible API against a real server, through the official `openai` client."""

from __future__ import annotations

import json
import stat

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import MAX_MODEL_LEN
from tests.e2e.harness import Server, wait_until

PROMPT = "Once upon a time"
CHAT = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Hello"}]


def test_models_lists_the_served_model(client: openai.OpenAI, server: Server) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [server.model]
    assert models[0].model_extra["max_model_len"] == MAX_MODEL_LEN


def test_completion(client: openai.OpenAI, server: Server) -> None:
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert resp.object == "text_completion" and resp.model == server.model
    assert resp.id.startswith("cmpl-")
    (choice,) = resp.choices
    assert choice.index == 0 and isinstance(choice.text, str)
    assert choice.finish_reason in ("length", "stop")
    assert resp.usage is not None and resp.usage.prompt_tokens > 0
    assert 0 < resp.usage.completion_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_greedy_completion_is_deterministic_and_stream_matches(
    client: openai.OpenAI, server: Server
) -> None:
    kw = {"model": server.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    first = client.completions.create(**kw).choices[0].text
    assert client.completions.create(**kw).choices[0].text == first
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == first
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_token_id_prompts_and_batched_prompts(client: openai.OpenAI, server: Server) -> None:
    resp = client.completions.create(
        model=server.model, prompt=[[1, 2, 3], [4, 5]], max_tokens=3, temperature=0, n=2
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2, 3]
    assert resp.usage is not None and resp.usage.prompt_tokens == 5
    resp = client.completions.create(model=server.model, prompt=["a b", "c d"], max_tokens=2)
    assert len(resp.choices) == 2


def test_chat_completion(client: openai.OpenAI, server: Server) -> None:
    resp = client.chat.completions.create(
        model=server.model, messages=CHAT, max_completion_tokens=8, temperature=0
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    assert resp.usage is not None and resp.usage.completion_tokens <= 8


def test_chat_stream_with_usage_matches_non_stream(client: openai.OpenAI, server: Server) -> None:
    kw = {"model": server.model, "messages": CHAT, "max_tokens": 10, "temperature": 0}
    whole = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_n_samples_with_seed_are_reproducible(client: openai.OpenAI, server: Server) -> None:
    kw = {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": 10,
        "temperature": 1.0,
        "n": 3,
        "seed": 1234,
    }
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    streamed = {i: "" for i in range(3)}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert [streamed[i] for i in range(3)] == [c.text for c in a.choices]


def test_completion_logprobs(client: openai.OpenAI, server: Server) -> None:
    resp = client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3
    )
    lp = resp.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0
        assert token in top and 1 <= len(top) <= 4
        # greedy: the sampled token is the most likely one
        assert logprob == pytest.approx(max(top.values()), abs=1e-4)


def test_chat_logprobs(client: openai.OpenAI, server: Server) -> None:
    resp = client.chat.completions.create(
        model=server.model,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)


def test_stop_string_ends_the_text(client: openai.OpenAI, server: Server) -> None:
    kw = {"model": server.model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    text = client.completions.create(**kw).choices[0].text
    stop = next((text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"greedy text {text!r} too short to pick a stop string from")
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.index(stop)]
    kept = client.completions.create(
        stop=[stop], extra_body={"include_stop_str_in_output": True}, **kw
    ).choices[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


def test_vllm_extensions_are_accepted(client: openai.OpenAI, server: Server) -> None:
    resp = client.completions.create(
        model=server.model,
        prompt=PROMPT,
        max_tokens=6,
        extra_body={
            "top_k": 5,
            "min_p": 0.01,
            "repetition_penalty": 1.2,
            "min_tokens": 6,
            "ignore_eos": True,
        },
    )
    assert resp.usage.completion_tokens == 6 and resp.choices[0].finish_reason == "length"


def test_health_version_metrics(client: openai.OpenAI, server: Server) -> None:
    # A request of its own, so that outcome="success" is there whichever tests ran before.
    client.completions.create(model=server.model, prompt=PROMPT, max_tokens=2, temperature=0)
    with server.http() as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert http.get("/version").json()["version"]
        text = http.get("/metrics").text
    for name in (
        "engine:http_requests_total",
        "engine:time_to_first_token_seconds_bucket",
        "engine:inter_token_latency_seconds_bucket",
        "engine:e2e_request_latency_seconds_bucket",
        "engine:num_requests_running",
        "engine:num_requests_waiting",
        "engine:kv_cache_usage_perc",
        "engine:prefix_cache_hits_total",
    ):
        assert name in text, name
    assert 'outcome="success"' in text
    # The weights' resident bytes by format: this float checkpoint's are all its dtype's.
    weights = [line for line in text.splitlines() if line.startswith("engine:model_weight_bytes{")]
    assert len(weights) == 1 and 'format="float32"' in weights[0], weights
    assert float(weights[0].rsplit(" ", 1)[1]) > 0


def _counters(server: Server) -> dict[tuple[str, str], float]:
    """/metrics' counters by (name, actor label or "")."""
    with server.http() as http:
        text = http.get("/metrics").text
    return {
        (sample.name, sample.labels.get("actor", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.endswith("_total")
    }


def test_metrics_show_where_a_running_batch_spends_its_time(
    client: openai.OpenAI, server: Server
) -> None:
    before = _counters(server)
    client.completions.create(
        model=server.model, prompt=PROMPT, max_tokens=8, extra_body={"ignore_eos": True}
    )

    def delta(name: str, actor: str = "") -> float:
        return counters[(name, actor)] - before.get((name, actor), 0.0)

    def reported() -> dict[tuple[str, str], float] | None:
        now = _counters(server)
        gaps = now.get(("engine:step_gaps_total", ""), 0.0)
        return now if gaps - before.get(("engine:step_gaps_total", ""), 0.0) >= 7 else None

    # One prefill step, then 7 decode steps that each follow the previous one's result. The
    # scheduler reports at intervals: wait for its figures to include them.
    counters = wait_until(reported, 10.0)
    assert delta("engine:steps_total") >= 8
    assert delta("engine:step_compute_seconds_total") > 0
    # The workers wait at least as long as the scheduler takes: its part lies inside each gap.
    gap = delta("engine:step_gap_seconds_total")
    assert 0 < delta("engine:step_gap_scheduler_seconds_total") <= gap
    for actor in ("root", "tokenizer", "scheduler", "worker0", "detokenizer"):
        assert counters[("engine:actor_cpu_seconds_total", actor)] > 0, actor


def test_unknown_route_gets_an_openai_error_body(server: Server) -> None:
    with server.http() as http:
        resp = http.get("/v1/nope")
    assert resp.status_code == 404 and resp.json()["error"]["message"]


def test_record_trace_appends_one_line_per_request(client: openai.OpenAI, server: Server) -> None:
    resp = client.completions.create(model=server.model, prompt=PROMPT, max_tokens=3)

    def my_records() -> list[dict]:  # type: ignore[type-arg]
        # Only whole lines: the writer may be half way through appending another request's.
        lines = server.extra["trace"].read_text().split("\n")[:-1]
        return [r for r in map(json.loads, lines) if r["request_id"] == resp.id]

    # A writer thread appends the line after the response has gone out: wait for it.
    (mine,) = wait_until(my_records, timeout=10)
    assert mine["endpoint"] == "completions" and mine["outcome"] == "success"
    assert stat.S_IMODE(server.extra["trace"].stat().st_mode) == 0o600  # prompts: owner-only
    assert mine["completion_tokens"] == resp.usage.completion_tokens
    assert mine["prompt_tokens"] == resp.usage.prompt_tokens
    assert 0 <= mine["ttft"] <= mine["e2e"]
