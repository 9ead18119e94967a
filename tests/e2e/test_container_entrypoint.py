"""The container image's command, run as the container would run it (Docker cannot run here).

The Dockerfile's ENTRYPOINT and CMD (`tini -- engine serve`; without tini where it is not
installed), with the image's ENV and every setting given as an ENGINE_* variable, against a
real server: a SIGTERM to the container's first process, as `docker stop` and Kubernetes send,
drains an in-flight stream to its last token before the exit (status 0) and leaves nothing
behind. The image's HEALTHCHECK script answers 0 against it and 1, in one line, where nothing
listens; a bad ENGINE_* variable stops the container with status 2 and one line naming it.
Only the host, port and engine home differ from the image's: the test binds 127.0.0.1 on a
free port and reuses this machine's kernel build.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx

from engine.settings.home import default_engine_home
from tests.deploy_files import ROOT, image_command, image_env
from tests.e2e.harness import READY_RE, leftover_ipc, read_line_starting, stop_process, wait_until
from tests.holds import HOLD_TEXT, hold_env

HEALTHCHECK = ROOT / "deploy" / "docker" / "healthcheck.py"
# Held (tests/holds.py): 6 s of tokens on any machine, still in flight when the signal comes.
STREAMED_TOKENS = 300


def container_argv() -> list[str]:
    entrypoint, command = image_command()
    if entrypoint[:2] == ["tini", "--"] and shutil.which("tini") is None:
        entrypoint = entrypoint[2:]  # tini only forwards the signal; the drain is the engine's
    return [*entrypoint, *command]


def container_env(model: str, admin_socket: Path, **settings: str) -> dict[str, str]:
    """The image's environment on this machine: its ENV over ours, the venv's `engine` first on
    PATH as /opt/engine/bin is in the image, the settings as ENGINE_* variables."""
    env = {**os.environ, **image_env()}
    env["TINI_SUBREAPER"] = "1"  # reaps orphans as it does as PID 1 (and says nothing of it)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    env |= {
        "ENGINE_HOME": str(default_engine_home()),
        "ENGINE_SERVER__HOST": "127.0.0.1",
        "ENGINE_SERVER__PORT": "0",
        "ENGINE_MODEL__PATH": model,
        "ENGINE_MODEL__DEVICE": "cpu",
        "ENGINE_MODEL__MAX_MODEL_LEN": "1024",
        "ENGINE_CACHE__KV_CACHE_MEMORY": "16MiB",
        "ENGINE_SERVER__DRAIN_TIMEOUT": "30",
        "ENGINE_ADMIN__SOCKET": str(admin_socket),
    }
    return env | settings


def healthcheck(url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ENGINE_HEALTHCHECK_URL": f"{url}/health"}
    return subprocess.run(
        [sys.executable, str(HEALTHCHECK)], env=env, capture_output=True, text=True, timeout=30
    )


def stream_in_thread(url: str, out: dict[str, Any]) -> threading.Thread:
    body = {"prompt": "a story" + HOLD_TEXT, "max_tokens": STREAMED_TOKENS, "ignore_eos": True}
    body |= {"stream": True, "stream_options": {"include_usage": True}}

    def run() -> None:
        try:
            with (
                httpx.Client(base_url=url, timeout=60) as http,
                http.stream("POST", "/v1/completions", json=body) as response,
            ):
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        out.setdefault("events", []).append(line[6:])
                        out["first"].set()
        except Exception as e:  # recorded for the assertion in the test
            out["error"] = e

    out["first"] = threading.Event()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def engine_pid(container: subprocess.Popen[str]) -> int:
    """The engine's pid: the container's first process itself, or tini's one child."""
    if Path(container_argv()[0]).name != "tini":
        return container.pid
    children = Path(f"/proc/{container.pid}/task/{container.pid}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def test_the_image_command_drains_on_sigterm(model_args: list[str], tmp_path: Path) -> None:
    env = container_env(model_args[1], tmp_path / "admin.sock") | hold_env()
    with open(tmp_path / "container.log", "w") as log:
        container = subprocess.Popen(
            container_argv(), env=env, stdout=subprocess.PIPE, stderr=log, text=True
        )
    try:
        ready = READY_RE.match(read_line_starting(container, "engine ready:", 180))
        assert ready, (tmp_path / "container.log").read_text()
        url, pid = ready["url"], engine_pid(container)
        assert healthcheck(url).returncode == 0
        out: dict[str, Any] = {}
        thread = stream_in_thread(url, out)
        assert out["first"].wait(60), out.get("error")
        container.send_signal(signal.SIGTERM)
        with httpx.Client(base_url=url, timeout=30) as http:
            wait_until(lambda: http.get("/ready").status_code == 503, timeout=30)
            assert http.get("/health").status_code == 200  # alive while it drains
            refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "server_error"
        thread.join(60)
        assert container.wait(60) == 0, (tmp_path / "container.log").read_text()
    finally:
        stop_process(container, 30)
    assert "error" not in out, out.get("error")
    usage = json.loads(out["events"][-2])["usage"]
    assert out["events"][-1] == "[DONE]" and usage["completion_tokens"] == STREAMED_TOKENS
    assert leftover_ipc(pid) == []
    assert not (tmp_path / "admin.sock").exists()
    down = healthcheck(url)
    assert down.returncode == 1 and len(down.stderr.splitlines()) == 1, down.stderr
    assert down.stderr.startswith(f"engine healthcheck: {url}/health: ")


def test_a_bad_engine_variable_stops_the_container_naming_it(tmp_path: Path) -> None:
    env = container_env("demo", tmp_path / "admin.sock", ENGINE_SCHEDULER__MAX_NUM_SEQS="0")
    done = subprocess.run(container_argv(), env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "engine: invalid setting scheduler.max_num_seqs (env ENGINE_SCHEDULER__MAX_NUM_SEQS): "
        "expected an integer >= 1, got '0'"
    ]
