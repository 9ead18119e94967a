"""P/D across instances on loopback: a `--kv-role prefill` instance and a `--kv-role decode`
instance behind `engine proxy`. The prefill instance computes each prompt and holds its KV; the
decode instance pulls it and generates. Greedy answers, plain and streamed, equal a colocated
instance's for the same requests, and the KV did move (no decode-side fallback).
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass

import openai
import pytest

from tests.e2e.conftest import server_args
from tests.e2e.harness import API_KEY, Server, start_server, wait_until
from tests.e2e.proxy_harness import Proxy, completion_fields, direct, metric, proxied
from tests.integration.test_fault_tolerance import alive, children_of

# Prompts of several KV blocks each, none a prefix of another: every one is pulled in full.
PROMPTS = [
    " ".join(f"{word}{i}" for i in range(24))
    for word in ("alpha", "bravo", "charlie", "delta", "echo")
]
MAX_TOKENS = 12


@dataclass
class Pair:
    proxy: Proxy
    prefill: Server
    decode: Server


@pytest.fixture(scope="module")
def pair(model_args: list[str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """The proxy in front of one prefill and one decode instance (all stopped on leaving)."""
    work = tmp_path_factory.mktemp("pd_pair")
    started: list[Server] = []
    try:
        for role in ("prefill", "decode"):
            args = server_args(model_args, None, "--kv-role", role)
            started.append(start_server(args, work, name=role))
        prefill, decode = started
        with proxied(work, [prefill.url], [decode.url]) as proxy:
            yield Pair(proxy, prefill, decode)
    finally:
        for srv in started:
            srv.stop()


def kv_figure(srv: Server, name: str) -> float:
    return metric(srv.url, f"engine:kv_transfer_{name}_total")


def test_greedy_answers_through_prefill_and_decode_instances_equal_a_colocated_ones(
    pair: Pair, server: Server
) -> None:
    decode = pair.decode
    pulls, fallbacks = kv_figure(decode, "pulls"), kv_figure(decode, "fallbacks")
    handoffs = kv_figure(pair.prefill, "handoffs")
    with pair.proxy.http() as http:
        for prompt in PROMPTS[:3]:
            body = {
                "model": server.model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0.0,
                "logprobs": 1,
            }
            through = http.post("/v1/completions", json=body)
            assert through.status_code == 200, through.text
            expected = completion_fields(direct(server, "/v1/completions", body).json())
            assert completion_fields(through.json()) == expected
    assert kv_figure(pair.prefill, "handoffs") == handoffs + 3
    assert kv_figure(decode, "pulls") == pulls + 3
    assert kv_figure(decode, "fallbacks") == fallbacks
    assert pair.proxy.metric("engine:proxy_prefill_without_kv_total") == 0
    assert pair.proxy.metric("engine:proxy_prefill_fallbacks_total") == 0


def test_a_streamed_chat_through_the_pair_equals_a_colocated_one(
    pair: Pair, server: Server
) -> None:
    decode = pair.decode
    pulls = kv_figure(decode, "pulls")
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": PROMPTS[3]}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": True,
    }
    texts = []
    for url in (pair.proxy.url, server.url):
        with openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0) as client:
            chunks = list(client.chat.completions.create(**body))
        texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
    assert texts[0] == texts[1]
    assert kv_figure(decode, "pulls") == pulls + 1
    with pair.proxy.http() as http, http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.read().endswith(b"data: [DONE]\n\n")


def test_forged_params_are_a_400_and_a_peer_without_the_secret_is_counted(
    pair: Pair, server: Server
) -> None:
    """A client that reaches the decode instance directly cannot point it anywhere, and one
    that reaches a kv_transfer port gets nothing but a count in /metrics."""
    body = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 1}
    prefilled = direct(pair.prefill, "/v1/completions", {**body, **REMOTE_DECODE})
    genuine = prefilled.json()["kv_transfer_params"]
    forged = {**genuine, "block_ids": genuine["block_ids"][:1], "num_tokens": 16}
    answer = direct(pair.decode, "/v1/completions", {**body, "kv_transfer_params": forged})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "kv_transfer_params" and "signature does not match" in error["message"]

    with socket.create_connection(("127.0.0.1", genuine["endpoints"][0]["port"]), 10) as sock:
        sock.sendall(b"\x00\x00\x00\x04junk")
        while sock.recv(4096):  # a challenge, a refusal, then the server closes
            pass
    wait_until(lambda: kv_figure(pair.prefill, "refused_connections") >= 1, timeout=10)


REMOTE_DECODE = {"kv_transfer_params": {"do_remote_decode": True}}


def test_with_its_prefill_instance_dead_the_decode_instance_prefills_itself(
    pair: Pair, server: Server
) -> None:
    """(Last here: it kills the prefill instance.)"""
    decode = pair.decode
    pulls = kv_figure(decode, "pulls")
    children = children_of(pair.prefill.pid)
    os.kill(pair.prefill.pid, signal.SIGKILL)
    pair.prefill.proc.wait(30)
    wait_until(lambda: not any(alive(pid) for pid in children), timeout=30)
    body = {"model": server.model, "prompt": PROMPTS[4], "max_tokens": MAX_TOKENS}
    with pair.proxy.http() as http:
        through = http.post("/v1/completions", json={**body, "temperature": 0.0})
    assert through.status_code == 200, through.text
    expected = direct(server, "/v1/completions", {**body, "temperature": 0.0}).json()
    assert completion_fields(through.json()) == completion_fields(expected)
    assert pair.proxy.metric("engine:proxy_prefill_fallbacks_total") == 1
    assert kv_figure(decode, "pulls") == pulls
