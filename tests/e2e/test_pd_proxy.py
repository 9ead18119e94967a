"""`python -m engine proxy` in front of real `python -m engine` instances on loopback.

Two instances (A: the prefill side, B: the decode side) serve every test; proxies are cheap
(under a second to start), so each test starts the one whose instance list it needs, some with
an address where nothing listens. The instances here are colocated ones, which accept and ignore
`kv_transfer_params`: what is proven is the proxy's side of the contract (which instance gets
what, streams relayed as they come, answers relayed unchanged, instances marked down and back
up), compared with what the decode instance answers directly.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import server_args
from tests.e2e.harness import API_KEY, Server, free_port, start_server, wait_until
from tests.e2e.proxy_harness import AUTH, Proxy, completion_fields, direct, metric, proxied
from tests.holds import HOLD_TEXT, hold_env
from tests.integration.test_fault_tolerance import alive, children_of

PROMPT = "The quick brown fox jumps over the lazy dog because"
GREEDY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
# Held (tests/holds.py): 20 ms a token on any machine, so a test acts while it still runs.
LONG = {"prompt": PROMPT + HOLD_TEXT, "max_tokens": 900, "temperature": 0.0, "ignore_eos": True}


class Instances:
    """A and B; a test that kills A puts its restarted successor here."""

    def __init__(self, a: Server, b: Server, args: list[str], log_dir: Path) -> None:
        self.a, self.b, self.args, self.log_dir = a, b, args, log_dir

    def restart_a(self) -> None:
        port = self.a.url.rsplit(":", 1)[1]
        args = list(self.args)
        args[args.index("--port") + 1] = port
        self.a = start_server(args, self.log_dir, hold_env(), name="a-restarted")


@pytest.fixture(scope="module")
def instances(
    model_args: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Instances]:
    work = tmp_path_factory.mktemp("pd_proxy")
    args = server_args(model_args, None)
    a = start_server(args, work, hold_env(), name="a")
    try:
        b = start_server(args, work, hold_env(), name="b")
    except BaseException:
        a.stop()
        raise
    pair = Instances(a, b, args, work)
    try:
        yield pair
    finally:
        pair.a.stop()
        pair.b.stop()


@pytest.fixture
def pd_proxy(instances: Instances, tmp_path: Path) -> Iterator[Proxy]:
    with proxied(tmp_path, [instances.a.url], [instances.b.url]) as proxy:
        yield proxy


def test_prefill_goes_to_the_prefill_instance_and_the_answer_to_the_decode_instances(
    instances: Instances, pd_proxy: Proxy
) -> None:
    a, b = instances.a, instances.b
    body = {"model": b.model, **GREEDY, "logprobs": 2}
    a_tokens, b_tokens = (metric(s.url, "engine:generation_tokens_total") for s in (a, b))
    prompt_tokens = "engine:prompt_tokens_total"
    a_prompts = metric(a.url, prompt_tokens)
    with pd_proxy.http() as http:
        through = http.post("/v1/completions", json=body)
    assert through.status_code == 200, through.text
    answer = through.json()
    # The prefill instance computed the prompt and one token; the decode instance the answer.
    assert metric(a.url, "engine:generation_tokens_total") == a_tokens + 1
    assert metric(a.url, prompt_tokens) == a_prompts + answer["usage"]["prompt_tokens"]
    assert metric(b.url, "engine:generation_tokens_total") == b_tokens + GREEDY["max_tokens"]
    reference = direct(b, "/v1/completions", body)
    assert completion_fields(answer) == completion_fields(reference.json())
    assert through.headers["content-type"] == reference.headers["content-type"]
    assert pd_proxy.metric("engine:proxy_requests_total", route="completions", status="200") == 1


def test_every_field_reaches_the_decode_instance(instances: Instances, pd_proxy: Proxy) -> None:
    """Seeded sampling of two choices with logprobs and a stop string: the decode instance's
    answer through the proxy is the one it gives directly."""
    b = instances.b
    body = {
        "model": b.model,
        "prompt": PROMPT,
        "max_tokens": 12,
        "n": 2,
        "temperature": 0.9,
        "top_k": 20,
        "seed": 1234,
        "logprobs": 1,
        "stop": ["\n\n"],
        "presence_penalty": 0.5,
    }
    with pd_proxy.http() as http:
        through = http.post("/v1/completions", json=body)
    assert through.status_code == 200, through.text
    assert completion_fields(through.json()) == completion_fields(
        direct(b, "/v1/completions", body).json()
    )


def test_a_chat_completion_through_the_proxy(instances: Instances, pd_proxy: Proxy) -> None:
    b = instances.b
    body = {
        "model": b.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_completion_tokens": 6,
        "temperature": 0.0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    with pd_proxy.http() as http:
        through = http.post("/v1/chat/completions", json=body)
    assert through.status_code == 200, through.text
    reference = direct(b, "/v1/chat/completions", body).json()
    assert completion_fields(through.json()) == completion_fields(reference)


def test_a_stream_is_relayed_event_by_event_as_an_event_stream(
    instances: Instances, pd_proxy: Proxy
) -> None:
    b = instances.b
    with pd_proxy.http() as http:
        body = {"model": b.model, **LONG, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("text/event-stream")
            request_id = resp.headers["x-request-id"]
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            # An event reached the client while the decode instance is still generating: the
            # proxy relays as chunks come, it does not wait for the end.
            assert request_id in {r["request_id"] for r in b.admin("requests")}
        # The client hung up: the proxy closes its upstream and the instance aborts the request.
        wait_until(lambda: not b.admin("requests"), timeout=30)
    assert pd_proxy.metric("engine:proxy_instance_outstanding", role="decode") == 0

    chat = {
        "model": b.model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 10,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }
    seen = [stream_text_and_usage(url, chat) for url in (pd_proxy.url, b.url)]
    assert seen[0] == seen[1]
    assert seen[0][1] is not None  # include_usage reached the decode instance


def test_a_client_that_leaves_before_a_non_streamed_answer_aborts_it_upstream(
    instances: Instances, pd_proxy: Proxy
) -> None:
    """The proxy closes its request to the decode instance, which stops generating (counted by
    tokens: the instance counts a non-streamed request aborted this way as a success)."""
    b = instances.b
    before = metric(b.url, "engine:generation_tokens_total")
    body = {"model": b.model, **LONG}
    # The client leaves after 0.25 s: well before the 900 held tokens (18 s on any machine).
    leave = httpx.Timeout(30, read=0.25)
    with pytest.raises(httpx.ReadTimeout), pd_proxy.http(timeout=leave) as h:
        h.post("/v1/completions", json=body)
    wait_until(lambda: not b.admin("requests"))
    assert metric(b.url, "engine:generation_tokens_total") - before < LONG["max_tokens"]
    wait_until(lambda: pd_proxy.metric("engine:proxy_instance_outstanding") == 0)


def test_abort_through_the_proxy_reaches_the_instance_decoding_the_request(
    instances: Instances, tmp_path: Path
) -> None:
    """With two decode instances the client cannot know which one has its request: the proxy
    asks every instance, and the stream ends as an aborted one does."""
    a, b = instances.a, instances.b
    body = {"model": b.model, **LONG, "stream": True}
    with proxied(tmp_path, [a.url], [a.url, b.url]) as proxy, proxy.http() as http:
        http.post("/v1/completions", json={"model": b.model, **GREEDY})  # next decode: on B
        with http.stream("POST", "/v1/completions", json=body) as resp:
            request_id = resp.headers["x-request-id"]
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            aborted = http.post("/abort", json={"request_id": request_id})
            rest = [line[6:] for line in lines if line.startswith("data: ")]
        assert aborted.status_code == 200, aborted.text
        assert aborted.json() == {"aborted": request_id}
        assert rest[-1] == "[DONE]"
        assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "abort"
        unknown = http.post("/abort", json={"request_id": "no-such-request"})
        assert unknown.status_code == 404
        assert unknown.json() == direct(b, "/abort", {"request_id": "no-such-request"}).json()


def test_concurrent_streams_spread_over_the_decode_instances(
    instances: Instances, tmp_path: Path
) -> None:
    """Four streams open at once through a proxy whose decode instances are A and B: each
    decodes two, and every stream is relayed whole (the same greedy text)."""
    a, b = instances.a, instances.b
    tokens = 200
    body = {"model": b.model, **LONG, "max_tokens": tokens, "stream": True}
    before = {srv.url: metric(srv.url, "engine:generation_tokens_total") for srv in (a, b)}
    with proxied(tmp_path, [a.url], [a.url, b.url]) as proxy, proxy.http() as http:
        with ExitStack() as open_streams:
            streams = [
                open_streams.enter_context(http.stream("POST", "/v1/completions", json=body))
                for _ in range(4)
            ]
            events = [[x for x in s.iter_lines() if x.startswith("data: ")] for s in streams]
        assert proxy.metric("engine:proxy_instance_outstanding") == 0
    texts = {"".join(json.loads(x[6:])["choices"][0]["text"] for x in e[:-1]) for e in events}
    assert len(texts) == 1
    assert all(e[-1] == "data: [DONE]" for e in events)
    assert all(json.loads(e[-2][6:])["choices"][0]["finish_reason"] == "length" for e in events)
    generated = {srv.url: metric(srv.url, "engine:generation_tokens_total") for srv in (a, b)}
    assert generated[a.url] - before[a.url] == 4 + 2 * tokens  # 4 prefills, 2 decodes
    assert generated[b.url] - before[b.url] == 2 * tokens


def stream_text_and_usage(url: str, body: dict[str, Any]) -> tuple[str, Any]:
    with openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0) as client:
        chunks = list(client.chat.completions.create(stream=True, **body))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # Prefix-cache hits differ between two sends of one prompt.
    usage = [c.usage.model_dump(exclude={"prompt_tokens_details"}) for c in chunks if c.usage]
    return text, usage[-1] if usage else None


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        ({"prompt": PROMPT, "max_tokens": -5}, AUTH),
        ({"prompt": PROMPT, "temperature": "hot"}, AUTH),
        ({"prompt": PROMPT, "max_tokens": 4}, {}),  # no API key: the instance's 401
        ({"model": "no-such-model", "prompt": PROMPT}, AUTH),
        (b"{not json", AUTH),
    ],
)
def test_an_instances_client_error_reaches_the_client_unchanged(
    instances: Instances, pd_proxy: Proxy, body: dict[str, Any] | bytes, headers: dict[str, str]
) -> None:
    if isinstance(body, dict):
        body = json.dumps({"model": instances.b.model, **body}).encode()
    answers = [
        httpx.post(
            url + "/v1/completions",
            content=body,
            headers={**headers, "content-type": "application/json"},
            timeout=60.0,
        )
        for url in (pd_proxy.url, instances.b.url)
    ]
    assert 400 <= answers[0].status_code < 500
    assert answers[0].status_code == answers[1].status_code
    assert answers[0].headers["content-type"] == answers[1].headers["content-type"]
    assert answers[0].json() == answers[1].json()


def test_request_ids_pass_through_and_one_is_made_when_absent(
    instances: Instances, pd_proxy: Proxy
) -> None:
    body = {"model": instances.b.model, **GREEDY}
    with pd_proxy.http() as http:
        named = http.post("/v1/completions", json=body, headers={"X-Request-Id": "pd-proxy-1"})
        unnamed = http.post("/v1/completions", json=body)
    assert named.status_code == unnamed.status_code == 200
    assert named.headers["x-request-id"] == "pd-proxy-1"
    assert named.json()["id"].endswith("pd-proxy-1")
    assert unnamed.headers["x-request-id"]


def test_other_routes_are_the_decode_instances(instances: Instances, pd_proxy: Proxy) -> None:
    b = instances.b
    with pd_proxy.http() as through, b.http() as straight:
        for method, path, body in [
            ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"model": b.model, "prompt": PROMPT}),
            ("GET", "/no/such/route", None),
        ]:
            ours = through.request(method, path, json=body)
            theirs = straight.request(method, path, json=body)
            assert (ours.status_code, ours.content) == (theirs.status_code, theirs.content)


def test_health_and_metrics_are_the_proxys_own(instances: Instances, pd_proxy: Proxy) -> None:
    health = httpx.get(pd_proxy.url + "/health", timeout=30.0)
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}  # public: no instance named
    detail = httpx.get(pd_proxy.url + "/health/instances", timeout=30.0)  # no --api-key: open
    assert detail.status_code == 200
    assert detail.json()["prefill"] == {instances.a.url: "up"}
    assert httpx.get(pd_proxy.url + "/ready", timeout=30.0).status_code == 200
    assert pd_proxy.metric("engine:proxy_instance_up", url=instances.a.url) == 1
    assert pd_proxy.metric("engine:proxy_instance_up", url=instances.b.url) == 1


def test_with_an_api_key_only_health_ready_and_metrics_are_open(
    instances: Instances, tmp_path: Path
) -> None:
    with proxied(tmp_path, [instances.a.url], [instances.b.url], "--api-key", API_KEY) as proxy:
        with httpx.Client(base_url=proxy.url, timeout=30.0) as anyone:
            assert anyone.get("/health").json() == {"status": "ok"}
            assert anyone.get("/ready").status_code == 200
            assert anyone.get("/metrics").status_code == 200
            for method, path in [
                ("GET", "/health/instances"),
                ("GET", "/v1/models"),
                ("POST", "/v1/completions"),
                ("POST", "/abort"),
            ]:
                refused = anyone.request(method, path, json={})
                assert refused.status_code == 401, (path, refused.text)
                assert refused.json()["error"]["type"] == "invalid_request_error"
                assert instances.a.url not in refused.text
            wrong = anyone.get("/health/instances", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
        with proxy.http() as holder:
            detail = holder.get("/health/instances")
            assert detail.status_code == 200
            assert detail.json()["decode"] == {instances.b.url: "up"}
            assert holder.get("/v1/models").status_code == 200


def test_no_decode_instance_up_is_a_503_that_names_it(instances: Instances, tmp_path: Path) -> None:
    nowhere = f"http://127.0.0.1:{free_port()}"
    with proxied(tmp_path, [instances.a.url], [nowhere]) as proxy, proxy.http() as http:
        answer = http.post(
            "/v1/completions",
            json={"model": instances.a.model, **GREEDY},
            headers={"X-Request-Id": "pd-proxy-503"},
        )
        health = http.get("/health")
        detail = http.get("/health/instances")
    assert answer.status_code == 503
    assert answer.headers["x-request-id"] == "pd-proxy-503"
    error = answer.json()["error"]
    assert error["code"] == 503
    assert error["message"].startswith(f"no decode instance is up ({nowhere} down since ")
    assert health.status_code == 503
    assert health.json()["error"]["message"] == "no decode instance is up"  # no URL, no error
    assert detail.status_code == 503
    assert detail.json()["error"]["message"].startswith(
        f"no decode instance is up ({nowhere} down since "
    )
    assert detail.json()["decode"][nowhere].startswith("down since ")


def test_a_stream_whose_decode_instance_stops_answering_ends_with_an_error_event(
    instances: Instances, tmp_path: Path
) -> None:
    """B is paused (SIGSTOP) mid-stream: past the read timeout (or once probes take B out of
    rotation, whichever comes first) the proxy ends the stream with an SSE error event naming
    B; resumed, B is probed back up."""
    b = instances.b
    flags = ("--read-timeout", "2", "--probe-interval", "0.5")
    with proxied(tmp_path, [instances.a.url], [b.url], *flags) as proxy, proxy.http() as http:
        body = {"model": b.model, **LONG, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            os.kill(b.pid, signal.SIGSTOP)
            try:
                events = [line[6:] for line in lines if line.startswith("data: ")]
            finally:
                os.kill(b.pid, signal.SIGCONT)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert f"decode instance {b.url} failed mid-stream" in error["message"]
        assert len(events) < LONG["max_tokens"]
        assert proxy.metric("engine:proxy_broken_streams_total") == 1
        wait_until(lambda: http.get("/health/instances").json()["decode"][b.url] == "up", 30)
        again = http.post("/v1/completions", json={"model": b.model, **GREEDY})
        assert again.status_code == 200, again.text
    wait_until(lambda: not b.admin("requests"), timeout=30)


def test_a_stopped_decode_instance_leaves_rotation_within_6_s_and_requests_go_on(
    instances: Instances, tmp_path: Path
) -> None:
    """B is paused (SIGSTOP) with no traffic: the probes take it out of rotation within 6 s,
    and one good probe takes it back once resumed. Paused again under traffic: every request
    succeeds, those sent to B moving to A once B is out, the p99 added latency under 15 s."""
    a, b = instances.a, instances.b
    body = {"model": b.model, **GREEDY}
    flags = ("--api-key", API_KEY)  # /health/instances then needs the key
    with proxied(tmp_path, [a.url], [a.url, b.url], *flags) as proxy, proxy.http() as http:

        def b_state() -> str:
            return str(http.get("/health/instances").json()["decode"][b.url])

        def timed() -> tuple[float, int]:
            started = time.monotonic()
            status = http.post("/v1/completions", json=body).status_code
            return time.monotonic() - started, status

        baseline = statistics.median(timed()[0] for _ in range(4))
        latencies: list[tuple[float, int]] = []
        os.kill(b.pid, signal.SIGSTOP)
        try:
            stopped = time.monotonic()
            wait_until(lambda: b_state() != "up", timeout=20, interval=0.1)
            out_after = time.monotonic() - stopped
            os.kill(b.pid, signal.SIGCONT)
            wait_until(lambda: b_state() == "up", timeout=20, interval=0.1)

            os.kill(b.pid, signal.SIGSTOP)
            stopped = time.monotonic()

            def client() -> None:
                while time.monotonic() - stopped < 6.0:
                    latencies.append(timed())

            with ThreadPoolExecutor(4) as pool:
                for done in [pool.submit(client) for _ in range(4)]:
                    done.result(timeout=120)
        finally:
            os.kill(b.pid, signal.SIGCONT)
        wait_until(lambda: b_state() == "up", timeout=20, interval=0.1)
    seconds = sorted(t for t, _ in latencies)
    p99_added = seconds[min(len(seconds) - 1, int(0.99 * len(seconds)))] - baseline
    print(f"\nout of rotation after {out_after:.2f} s; {len(seconds)} requests while stopped,")
    print(f"p99 added latency {p99_added:.2f} s, most {seconds[-1] - baseline:.2f} s", end=" ")
    print(f"(baseline {baseline * 1000:.0f} ms)")
    assert out_after < 6.0
    assert [s for _, s in latencies if s != 200] == []
    assert len(latencies) >= 4
    assert p99_added < 15.0


class _Erring(ThreadingHTTPServer):
    """A peer instance that is ready (/ready 200) and answers every request 500."""

    daemon_threads = True

    def __init__(self) -> None:
        self.posts = 0
        super().__init__(("127.0.0.1", 0), _ErringHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _ErringHandler(BaseHTTPRequestHandler):
    server: _Erring

    def do_GET(self) -> None:
        self._answer(200, b'{"status": "ok"}')

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        self.server.posts += 1
        self._answer(500, ERRING_BODY)

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


ERRING_BODY = b'{"error": {"message": "always 500", "type": "server_error", "code": 500}}'


def test_a_request_that_always_gets_a_500_leaves_every_instance_up(
    instances: Instances, tmp_path: Path
) -> None:
    """Decode instances E1 and E2 answer every request 500 (and are ready), prefill on A or E1:
    each request is sent once more elsewhere, its 500 reaches the client, nothing goes down."""
    a = instances.a
    erring = [_Erring(), _Erring()]
    threads = [threading.Thread(target=e.serve_forever, daemon=True) for e in erring]
    for thread in threads:
        thread.start()
    e1, e2 = erring
    try:
        with proxied(tmp_path, [a.url, e1.url], [e1.url, e2.url]) as proxy, proxy.http() as http:
            for stream in (False, True) * 3:
                body = {"model": a.model, **GREEDY, "stream": stream}
                answer = http.post("/v1/completions", json=body)
                assert answer.status_code == 500
                assert answer.content == ERRING_BODY
            time.sleep(1.5)  # probes go on meanwhile: still nothing down
            detail = http.get("/health/instances").json()
            assert detail["status"] == "ok"
            states = [state for role in ("prefill", "decode") for state in detail[role].values()]
            assert states == ["up"] * 4
            assert proxy.metric("engine:proxy_instance_failures_total") == 0
            assert proxy.metric("engine:proxy_upstream_5xx_total", role="decode") == 12
            assert e2.posts + e1.posts >= 12  # decodes (each once elsewhere), prefills on E1
    finally:
        for server in erring:
            server.shutdown()
            server.server_close()
        for thread in threads:
            thread.join(timeout=10)


def test_a_killed_instance_is_marked_down_skipped_and_taken_back_once_restarted(
    instances: Instances, tmp_path: Path
) -> None:
    """A dies (SIGKILL). Proxy `solo` has A as its only prefill instance and as a decode
    instance: requests are still served (decoded on B without KV, after A fails as a decode
    instance before its first byte unless a probe found it dead first), /health names A, and
    once A is restarted on its port the proxy prefills on it again. Proxy `both` prefills on A
    and B in turn: the request that finds A dead is prefilled on B instead."""
    a, b = instances.a, instances.b
    body = {"model": b.model, **GREEDY}
    expected = completion_fields(direct(b, "/v1/completions", body).json())
    flags = ("--probe-interval", "0.5")
    with (
        proxied(tmp_path, [a.url], [b.url, a.url], *flags, name="solo") as solo,
        proxied(tmp_path, [a.url, b.url], [b.url], name="both") as both,
    ):
        for proxy in (solo, both):  # solo: decoded on B, A next in turn; both: prefilled on A
            with proxy.http() as http:
                assert completion_fields(http.post("/v1/completions", json=body).json()) == expected
        children = children_of(a.pid)
        os.kill(a.pid, signal.SIGKILL)
        a.proc.wait(30)
        wait_until(lambda: not any(alive(pid) for pid in children), timeout=30)
        for proxy in (solo, both):
            with proxy.http() as http:
                for _ in range(2):
                    answer = http.post("/v1/completions", json=body)
                    assert answer.status_code == 200, answer.text
                    assert completion_fields(answer.json()) == expected
        assert solo.metric("engine:proxy_prefill_fallbacks_total") == 2
        # Which of a request and a probe finds A dead first is a race: at most one retry.
        assert solo.metric("engine:proxy_retries_total", role="decode") <= 1
        assert solo.metric("engine:proxy_instance_up", url=a.url) == 0
        assert both.metric("engine:proxy_prefill_fallbacks_total") == 0
        assert both.metric("engine:proxy_retries_total", role="prefill") <= 1
        with solo.http() as http:
            health = http.get("/health")
            assert health.status_code == 503
            assert a.url not in health.text
            detail = http.get("/health/instances")
            assert f"no prefill instance is up ({a.url} down since " in detail.text

            instances.restart_a()
            wait_until(lambda: http.get("/health").status_code == 200, timeout=60)
            a_requests = metric(a.url, "engine:http_requests_total")
            answer = http.post("/v1/completions", json=body)
        assert completion_fields(answer.json()) == expected
        assert metric(a.url, "engine:http_requests_total") > a_requests
        assert solo.metric("engine:proxy_prefill_fallbacks_total") == 2  # prefilled on A

        # Drained, A answers 503 (and /ready 503): the 503s move the request on (the decode
        # instance prefills) and probes take A down, and do not take it back.
        assert instances.a.admin("drain")["drained"]
        with solo.http() as http:
            answer = http.post("/v1/completions", json=body)
            assert completion_fields(answer.json()) == expected
            assert solo.metric("engine:proxy_prefill_fallbacks_total") == 3
            wait_until(
                lambda: "/ready answered 503" in http.get("/health/instances").text, timeout=30
            )
            assert solo.metric("engine:proxy_instance_up", role="prefill", url=a.url) == 0


def test_sigterm_lets_an_inflight_stream_finish(instances: Instances, tmp_path: Path) -> None:
    b = instances.b
    body = {"model": b.model, **LONG, "max_tokens": 300, "stream": True}
    with proxied(tmp_path, [instances.a.url], [b.url]) as proxy, proxy.http() as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            proxy.proc.send_signal(signal.SIGTERM)
            events = [line[6:] for line in lines if line.startswith("data: ")]
        assert proxy.proc.wait(30) == 0
    assert events[-1] == "[DONE]"
    finished = json.loads(events[-2])["choices"][0]
    assert finished["finish_reason"] == "length"
