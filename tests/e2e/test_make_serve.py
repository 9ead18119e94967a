"""`make serve`, the README's serve command, comes up on the built-in demo model and answers."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx

from tests.e2e.harness import READY_RE, REPO, read_line_starting

START_TIMEOUT_S = 300.0  # the first start on a machine builds the demo model


def test_make_serve_answers_a_completion_on_the_demo_model(tmp_path) -> None:  # type: ignore[no-untyped-def]
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
        reply = httpx.post(
            f"{match['url']}/v1/completions",
            json={"model": match["model"], "prompt": "Hello", "max_tokens": 5, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == 5
        assert "demo model" in log_path.read_text()
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


def _assert_group_gone(pgid: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes of make serve's group {pgid} are still running")
