"""`make serve`, the README's serve command, comes up on the default model (SmolLM2-135M-Instruct,
a real one) and answers a chat question."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx

from tests.e2e.harness import READY_RE, REPO, read_line_starting

START_TIMEOUT_S = 300.0  # the first start on a machine derives the model's files
# The README's question. On the default model's file (and transformers' float load of it) every
# token of "The capital of Japan is Tokyo." leads the next by over 1 nat (France's answer
# leads by 0.03-0.36, and flips between machines).
QUESTION = "What is the capital of Japan?"
ANSWER = "Tokyo"
SURE_MARGIN = 0.5  # nats between a token and the runner-up: several times any host's drift


def test_make_serve_answers_a_chat_question_on_the_default_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
    log_path = tmp_path / "make-serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        # Its own session, so the test can signal make and the server it runs, and nothing else.
        make = subprocess.Popen(
            ["make", "--no-print-directory", "serve", "SERVE_ARGS=--port 0"],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
    try:
        line = read_line_starting(make, "engine ready:", START_TIMEOUT_S)
        match = READY_RE.match(line)
        assert match, line
        assert match["model"] == "SmolLM2-135M-Instruct"
        models = httpx.get(f"{match['url']}/v1/models", timeout=60).json()
        assert [model["id"] for model in models["data"]] == ["SmolLM2-135M-Instruct"]
        question = {"role": "user", "content": QUESTION}
        reply = httpx.post(
            f"{match['url']}/v1/chat/completions",
            json={
                "messages": [question],
                "max_tokens": 16,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            },
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        # A greedy answer is asserted only as far as the model is sure of it: a near-tie flips
        # with the host's vector width (logits shift by ~0.1 between AVX2 and AVX-512 hosts).
        sure = ""
        for token in choice["logprobs"]["content"]:
            margin = _margin(token)
            assert margin > SURE_MARGIN, f"unsure ({margin:.2f}) at {token['token']!r} in {sure!r}"
            sure += token["token"]
            if ANSWER in sure:
                break
        assert ANSWER in sure, choice["message"]["content"]
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGTERM)
        try:
            make.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(make.pid, signal.SIGKILL)
            make.wait(10)
        if make.stdout is not None:
            make.stdout.close()
    _assert_group_gone(make.pid)


def _margin(token: dict) -> float:  # type: ignore[type-arg]
    """How far the chosen token's logprob leads the best other one's."""
    others = [t["logprob"] for t in token["top_logprobs"] if t["token"] != token["token"]]
    return float(token["logprob"] - max(others, default=float("-inf")))


def _assert_group_gone(pgid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes of make serve's group {pgid} are still running")
