"""Admin socket commands, client disconnects, and the two ways to stop a server (admin
shutdown; SIGTERM: tests/e2e/test_container_entrypoint.py) — each drains in-flight requests
and leaves nothing behind."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from engine.settings.api_key import COMMAND_LINE_WARNING
from tests.e2e.conftest import server_args
from tests.e2e.harness import REPO, Server, leftover_ipc, start_server, wait_until
from tests.holds import HOLD_TEXT, hold_env

# Held (tests/holds.py): in flight for 20 s on any machine, so still running when a test acts.
LONG_STREAM = {
    "prompt": "a long story" + HOLD_TEXT,
    "max_tokens": 1000,
    "ignore_eos": True,
    "stream": True,
}
DRAINED_TOKENS = 300  # held: 6 s after its first token, time for the drain to come


def admin_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", "admin", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


def idle(server: Server) -> bool:
    stats = server.admin("stats")
    running = stats.get("running", stats.get("num_running"))
    return not server.admin("requests") and running == 0 and stats["kv_usage"] == 0


def test_admin_socket_is_owner_only(server: Server) -> None:
    mode = server.admin_socket.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600


def test_admin_read_commands(server: Server) -> None:
    health = server.admin("health")
    assert health["ready"] is True and health["not_ready"] == []
    with server.http() as http:  # the scheduler reports its figures once it has stepped
        http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).raise_for_status()
    stats = wait_until(lambda: (s := server.admin("stats")) and "kv_usage" in s and s, timeout=30)
    for key in ("kv_usage", "prefix_cache_hit_rate", "restarts"):
        assert key in stats
    assert {"running", "num_running"} & set(stats) and {"waiting", "num_waiting"} & set(stats)
    actors = server.admin("actors")
    assert actors and all(
        {"name", "role", "pid", "state", "restarts", "last_restart_reason"} <= set(a)
        for a in actors
    )
    assert isinstance(server.admin("requests"), list)


def test_admin_cli_table_and_json(server: Server) -> None:
    """Each reply names the server it came from; a wrong command line is a usage error (2),
    a command the server refuses 1, as the README says."""
    table = admin_cli("--socket", str(server.admin_socket), "actors")
    assert table.returncode == 0, table.stderr
    named, header = table.stdout.splitlines()[:2]
    assert named == f"server: pid {server.pid} at {server.url} ({server.model})"
    assert "NAME" in header and "PID" in header and "RESTARTS" in header
    as_json = admin_cli("--socket", str(server.admin_socket), "stats", "--json")
    assert as_json.returncode == 0 and json.loads(as_json.stdout)["ok"] is True
    identity = {"pid": server.pid, "url": server.url, "model": server.model}
    assert json.loads(as_json.stdout)["server"] == identity
    bad = admin_cli("--socket", str(server.admin_socket), "abort")
    assert bad.returncode == 2 and "abort takes 1 argument" in bad.stderr
    unknown = admin_cli("--socket", str(server.admin_socket), "frobnicate")
    assert unknown.returncode == 2 and "unknown command" in unknown.stderr
    refused = admin_cli("--socket", str(server.admin_socket), "log-level", "loud")
    assert refused.returncode == 1 and "one of" in refused.stderr


def test_admin_log_level(server: Server) -> None:
    assert server.admin("log-level", "debug") == {"log_level": "debug"}
    assert server.admin("log-level", "info") == {"log_level": "info"}
    reply = server.admin_reply("log-level", "loud")
    assert not reply["ok"] and "one of" in reply["error"]


def test_admin_abort_ends_a_running_request(server: Server) -> None:
    with server.http() as http, http.stream("POST", "/v1/completions", json=LONG_STREAM) as resp:
        assert resp.status_code == 200
        request_id = resp.headers["x-request-id"]
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        assert request_id in {r["request_id"] for r in server.admin("requests")}
        assert server.admin("abort", request_id) == {"aborted": request_id}
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    finish = [json.loads(x[6:])["choices"][0]["finish_reason"] for x in rest[:-1]]
    assert finish[-1] == "abort"
    assert sum(1 for x in rest if x != "data: [DONE]") < LONG_STREAM["max_tokens"]
    wait_until(lambda: idle(server), timeout=30)
    reply = server.admin_reply("abort", "no-such-request")
    assert not reply["ok"] and "no-such-request" in reply["error"]


def aborted_count(server: Server) -> float:
    with server.http() as http:
        text = http.get("/metrics").text
    for labels, value in re.findall(
        r"^engine:http_requests_total\{([^}]*)\} ([0-9.]+)$", text, re.M
    ):
        if 'endpoint="completions"' in labels and 'outcome="aborted"' in labels:
            return float(value)
    return 0.0


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: Server) -> None:
    aborted_before = aborted_count(server)
    with server.http() as http, http.stream("POST", "/v1/completions", json=LONG_STREAM) as resp:
        request_id = resp.headers["x-request-id"]
        lines = resp.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        wait_until(lambda: server.admin("stats").get("kv_usage", 0) > 0, timeout=30)
        assert request_id in {r["request_id"] for r in server.admin("requests")}
    # leaving the block closed the connection mid-stream
    wait_until(lambda: idle(server), timeout=30)
    assert aborted_count(server) == aborted_before + 1


def test_disconnect_during_non_streamed_request_aborts(server: Server) -> None:
    aborted_before = aborted_count(server)
    body = {**LONG_STREAM, "stream": False}
    with pytest.raises(httpx.ReadTimeout), server.http(timeout=httpx.Timeout(30, read=1.0)) as http:
        http.post("/v1/completions", json=body)
    wait_until(lambda: idle(server), timeout=30)
    # Counted as aborted, not as a success (it was, while the abort marked it finished).
    wait_until(lambda: aborted_count(server) == aborted_before + 1, timeout=30)


def _stream_in_thread(server: Server, out: dict[str, Any]) -> threading.Thread:
    def run() -> None:
        try:
            with (
                server.http() as http,
                http.stream(
                    "POST",
                    "/v1/completions",
                    json={
                        **LONG_STREAM,
                        "max_tokens": DRAINED_TOKENS,
                        "stream_options": {"include_usage": True},
                    },
                ) as resp,
            ):
                out["status"] = resp.status_code
                out["events"] = []
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        out["events"].append(line[6:])
                        out.setdefault("first", threading.Event()).set()
        except Exception as e:  # recorded for the assertion below
            out["error"] = e

    out["first"] = threading.Event()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _assert_stream_completed(out: dict[str, Any]) -> None:
    assert "error" not in out, out.get("error")
    events = out["events"]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"
    # every token arrived: the drain let the request finish
    assert json.loads(events[-2])["usage"]["completion_tokens"] == DRAINED_TOKENS


def test_admin_drain_then_shutdown_with_socket_discovery(
    model_args: list[str], tmp_path: Path
) -> None:
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(runtime)}
    srv = start_server(
        server_args(model_args, None), tmp_path, env={**env, **hold_env()}, name="drain"
    )
    try:
        assert srv.admin_socket == runtime / "engine" / str(srv.pid) / "admin.sock"
        assert stat.S_IMODE(srv.admin_socket.parent.stat().st_mode) == 0o700
        health = admin_cli("health", env=env)  # no --socket: found in the runtime dir
        assert health.returncode == 0 and "ready" in health.stdout
        assert health.stdout.startswith(f"server: pid {srv.pid} at {srv.url}")
        _two_servers_are_refused_until_one_is_named(srv, model_args, tmp_path, env)
        out: dict[str, Any] = {}
        thread = _stream_in_thread(srv, out)
        assert out["first"].wait(60)
        drained = admin_cli("drain", "--json", env=env)
        assert drained.returncode == 0, drained.stderr
        assert json.loads(drained.stdout)["result"]["drained"] is True
        thread.join(60)
        _assert_stream_completed(out)
        with srv.http() as http:
            assert http.get("/health").json() == {"status": "draining"}
        assert admin_cli("shutdown", env=env).returncode == 0
        assert srv.proc.wait(60) == 0
    finally:
        srv.stop()
    assert not srv.admin_socket.parent.exists()
    assert leftover_ipc(srv.pid) == []
    gone = admin_cli("health", env=env)
    assert gone.returncode == 2 and "no running engine" in gone.stderr


def _two_servers_are_refused_until_one_is_named(
    srv: Server, model_args: list[str], tmp_path: Path, env: dict[str, str]
) -> None:
    other = start_server(server_args(model_args, None), tmp_path, env=env, name="other")
    try:
        both = admin_cli("health", env=env)
        assert both.returncode == 2 and len(both.stderr.splitlines()) == 1, both.stderr
        for each in (srv, other):
            assert f"pid {each.pid} at {each.url} ({each.model})" in both.stderr
        port = urlsplit(other.url).port
        by_port = admin_cli("--port", str(port), "health", env=env)
        assert by_port.stdout.startswith(f"server: pid {other.pid} at {other.url}")
        assert admin_cli("--pid", str(other.pid), "shutdown", env=env).returncode == 0
        assert other.proc.wait(60) == 0
    finally:
        other.stop()


def test_engine_that_gives_up_stops_the_server_with_its_reason(
    model_args: list[str], tmp_path: Path
) -> None:
    args = server_args(model_args, tmp_path / "a.sock", "--runtime.restart_intensity", "0")
    srv = start_server(args, tmp_path, name="escalate")
    try:
        (tokenizer,) = [a for a in srv.admin("actors") if a["name"] == "tokenizer"]
        os.kill(tokenizer["pid"], signal.SIGKILL)  # a child of the server this test started
        assert srv.proc.wait(60) == 1
    finally:
        srv.stop()
    assert "engine: stopped:" in srv.log()
    assert COMMAND_LINE_WARNING in srv.log()  # it was given --api-key: every user can read it
    assert not (tmp_path / "a.sock").exists()
    assert leftover_ipc(srv.pid) == []
