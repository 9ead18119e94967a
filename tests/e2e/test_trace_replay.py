"""Record → replay against real servers.

A recording server (`--record-trace FILE`, `--deterministic`) serves a mixed workload sent by
real clients; its trace is replayed through `python -m engine replay` against itself, where every
greedy and seeded output must match though a long prompt now comes from the prefix cache, and
against a second instance started here (not deterministic: differences are listed, not failed).
A trace the server is still recording into is refused. The second instance records to
/dev/full, where every write fails with ENOSPC: recording stops with a log line and serving goes
on. Imports from public-trace formats (files written here) replay too, and shared Mooncake
hash_ids show up as prefix-cache hits.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import server_args
from tests.e2e.harness import API_KEY, REPO, Server, start_server, wait_until

# Short prompts (under one 16-token KV block, chat template included) so that replaying them
# on a fresh server makes no prefix-cache hit: the Mooncake test's hits are its own.
GREEDY = {"temperature": 0}
LONG_PROMPT = " ".join(f"the lamp number {i} was lit" for i in range(12))
WORKLOAD: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"prompt": "The river", "max_tokens": 12, **GREEDY}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 20, "stream": True, **GREEDY}),
    ("/v1/completions", {"prompt": [5, 9, 33, 71, 140], "max_tokens": 8, **GREEDY}),
    ("/v1/completions", {"prompt": ["A cat", "The old house"], "max_tokens": 6, **GREEDY}),
    (
        "/v1/completions",
        {"prompt": "Seeded", "max_tokens": 10, "temperature": 0.9, "seed": 7, "n": 2},
    ),
    ("/v1/completions", {"prompt": "Sampled freely", "max_tokens": 6, "temperature": 1.0}),
    ("/v1/completions", {"prompt": "stop here", "max_tokens": 30, "stop": ["e"], **GREEDY}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 10,
            "stream": True,
            **GREEDY,
        },
    ),
    ("/v1/completions", {"prompt": "too long", "max_tokens": 5000, **GREEDY}),  # refused: 400
    # Three KV blocks and more: a prefix-cache hit when replayed on the recording server.
    ("/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 12, **GREEDY}),
]
DETERMINISTIC_OK = 8  # every request above but the free sample and the refused one
EXTRA_ARGS = ["--max-queued-samples", "64", "--max-num-seqs", "8"]


def run_cli(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "engine", *args],
        cwd=REPO,
        env={**os.environ, "ENGINE_API_KEY": API_KEY},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def replay(trace: Path, server: Server, *flags: str) -> tuple[int, dict[str, Any], str]:
    done = run_cli("replay", str(trace), "--url", server.url, "--json", *flags)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, json.loads(done.stdout), done.stderr


@pytest.fixture(scope="module")
def servers(
    model_args: list[str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Server, Server]]:
    """(recording server, second instance recording to /dev/full), started side by side."""
    work = tmp_path_factory.mktemp("trace")
    trace = work / "recorded.jsonl"
    specs = [
        ("recorder", ["--record-trace", str(trace), "--deterministic"]),
        ("replayer", ["--record-trace", "/dev/full"]),
    ]
    started: dict[str, Server] = {}
    errors: list[BaseException] = []

    def start(name: str, extra: list[str]) -> None:
        try:
            args = server_args(model_args, work / f"{name}.sock", *EXTRA_ARGS, *extra)
            started[name] = start_server(args, work, name=name)
        except BaseException as e:  # reported below, after both attempts
            errors.append(e)

    threads = [threading.Thread(target=start, args=spec) for spec in specs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    try:
        if errors:
            raise errors[0]
        started["recorder"].extra["trace"] = trace
        yield started["recorder"], started["replayer"]
    finally:
        for srv in started.values():
            srv.stop()


@pytest.fixture(scope="module")
def recording(servers: tuple[Server, Server]) -> Path:
    """The recording server's trace of WORKLOAD, sent concurrently by real clients."""
    recorder, _ = servers

    def send(item: tuple[str, dict[str, Any]]) -> int:
        path, body = item
        with recorder.http() as http:
            return http.post(path, json=body).status_code

    with ThreadPoolExecutor(len(WORKLOAD)) as pool:
        statuses = list(pool.map(send, WORKLOAD))
    assert statuses == [200] * (len(WORKLOAD) - 2) + [400, 200]
    trace: Path = recorder.extra["trace"]
    # Complete lines only: the writer may be half way through the last one.
    wait_until(lambda: trace.exists() and trace.read_text().count("\n") == len(WORKLOAD))
    # A copy: replays against the recording server append their own lines to its trace.
    snapshot = trace.with_name("workload.jsonl")
    snapshot.write_bytes(trace.read_bytes())
    return snapshot


def test_the_recording_holds_outcomes_tokens_and_their_times(recording: Path) -> None:
    records = [json.loads(line) for line in recording.read_text().splitlines()]
    assert {r["v"] for r in records} == {1}
    by_prompt = {json.dumps(r["body"].get("prompt")): r for r in records}
    batched = by_prompt[json.dumps(["A cat", "The old house"])]
    assert batched["outcome"] == "success" and batched["status"] == 200
    assert [c["index"] for c in batched["choices"]] == [0, 1]
    for choice in batched["choices"]:
        assert len(choice["token_ids"]) == len(choice["token_times"]) == 6
        assert choice["token_times"] == sorted(choice["token_times"])
        assert choice["finish_reason"] == "length" and choice["text"]
    refused = by_prompt[json.dumps("too long")]
    assert (refused["outcome"], refused["status"]) == ("bad_request", 400)
    assert "choices" not in refused  # nothing was generated; empty fields are left out


def test_replay_against_the_recording_server_matches_every_deterministic_output(
    servers: tuple[Server, Server], recording: Path
) -> None:
    recorder, _ = servers
    status, report, _ = replay(recording, recorder, "--compare", "--speed", "4", "--no-progress")
    assert status == 1  # the refused request is refused again: one failure
    assert (report["replay"]["requests"], report["replay"]["ok"]) == (len(WORKLOAD), 9)
    assert report["failures"] == {"HTTP 400": 1}
    assert (report["recorded"]["ok"], report["recorded"]["failed"]) == (9, 1)
    comparison = report["comparison"]
    assert comparison["may_differ"] is None  # both runs --deterministic: the comparison is exact
    assert comparison["mismatches"] == []
    assert comparison["checked"] == comparison["matched"] == DETERMINISTIC_OK
    assert report["replay"]["ttft"]["count"] == 9 and report["replay"]["e2e"]["p99"] > 0


def test_replay_against_a_second_instance_skips_bad_lines_and_plots(
    servers: tuple[Server, Server], recording: Path, tmp_path: Path
) -> None:
    _, second = servers
    lines = recording.read_text().splitlines()
    damaged = tmp_path / "damaged.jsonl"
    damaged.write_text("\n".join([lines[0], "{broken", *lines[1:], '{"arrival": 1}']) + "\n")
    plot = tmp_path / "replay.png"
    status, report, stderr = replay(
        damaged, second, "--compare", "--max-concurrency", "3", "--plot", str(plot)
    )
    assert status == 1 and report["failures"] == {"HTTP 400": 1}, report["failed_requests"]
    first, last = report["problems"]
    assert first.startswith("line 2: not valid JSON")
    assert last == f"line {len(lines) + 2}: missing required field `v`"
    assert "line 2: not valid JSON" in stderr and f"line {len(lines) + 2}:" in stderr
    assert report["replay"]["requests"] == len(WORKLOAD) and report["replay"]["ok"] == 9
    # Other kernels than the recording's: outputs may differ, and the report says why.
    assert report["comparison"]["checked"] == DETERMINISTIC_OK
    assert report["comparison"]["may_differ"].startswith("this server runs without --determ")
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_full_disk_stops_recording_not_serving(servers: tuple[Server, Server]) -> None:
    _, second = servers
    with second.http() as http:
        for _ in range(2):
            resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
            assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3
    log = wait_until(lambda: "trace recording stopped" in (text := second.log()) and text)
    (line,) = [ln for ln in log.splitlines() if "trace recording stopped" in ln]
    assert "/dev/full" in line and "No space left on device" in line


def test_shared_mooncake_hash_ids_are_prefix_cache_hits(
    servers: tuple[Server, Server], tmp_path: Path
) -> None:
    _, second = servers
    source = tmp_path / "mooncake.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 2048, "output_length": 4, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 200, "input_length": 2048, "output_length": 4, "hash_ids": [0, 1, 2, 4]},
        {"timestamp": 400, "input_length": 1500, "output_length": 4, "hash_ids": [0, 1, 5]},
        {"timestamp": 600, "input_length": 2048, "output_length": 4, "hash_ids": [0, 1, 2, 6]},
    ]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = tmp_path / "mooncake-trace.jsonl"
    done = run_cli(
        "trace", "import", "mooncake", str(source), "--block-tokens", "32", "-o", str(trace)
    )
    assert done.returncode == 0, done.stderr
    assert "wrote 4 requests" in done.stderr
    before = second.admin("stats")["prefix_cache_hit_rate"]
    status, report, _ = replay(trace, second, "--max-concurrency", "1", "--no-progress")
    assert status == 0 and report["replay"]["ok"] == 4 and report["recorded"] is None
    assert report["replay"]["output_tokens"] == 16  # ignore_eos: exactly as the trace says
    # Every request after the first shares two or three 32-token blocks (4-6 KV blocks).
    wait_until(lambda: second.admin("stats")["prefix_cache_hit_rate"] > before, timeout=30)


def test_an_azure_import_replays_with_limit_and_model_override(
    servers: tuple[Server, Server], tmp_path: Path
) -> None:
    _, second = servers
    source = tmp_path / "azure.csv"
    source.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:46.9000000,96,9\n"
        "2023-11-16 18:15:47.1000000,oops,9\n"
        "2023-11-16 18:15:47.2000000,200,120\n"
        "2023-11-16 18:15:48.0000000,50,5\n"
    )
    trace = tmp_path / "azure-trace.jsonl"
    done = run_cli(
        "trace",
        "import",
        "azure",
        str(source),
        "--input-scale",
        "0.25",
        "--max-output",
        "8",
        "-o",
        str(trace),
    )
    assert done.returncode == 0, done.stderr
    assert "line 4: ContextTokens must be an integer token count, got 'oops'" in done.stderr
    status, report, _ = replay(trace, second, "--limit", "3", "--model", second.model)
    assert status == 0 and report["replay"]["requests"] == report["replay"]["ok"] == 3
    assert report["replay"]["output_tokens"] == 8 + 8 + 8
    wrong, bad_model, _ = replay(trace, second, "--limit", "1", "--model", "no-such-model")
    assert wrong == 1 and bad_model["failures"] == {"HTTP 404": 1}


def test_replay_usage_errors(servers: tuple[Server, Server], tmp_path: Path) -> None:
    recorder, second = servers
    live: Path = recorder.extra["trace"]
    lines = live.read_text().count("\n")
    into_itself = run_cli("replay", str(live), "--url", recorder.url)
    assert into_itself.returncode == 2, into_itself.stderr
    assert f"a running server is recording into {live}" in into_itself.stderr
    assert live.read_text().count("\n") == lines  # nothing was sent
    missing = run_cli("replay", str(tmp_path / "absent.jsonl"), "--url", second.url)
    assert missing.returncode == 2 and "cannot read" in missing.stderr
    bad_speed = run_cli("replay", "x", "--url", second.url, "--speed", "0")
    assert bad_speed.returncode == 2 and "expected a number > 0, got '0'" in bad_speed.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("{nope\n")
    nothing = run_cli("replay", str(empty), "--url", second.url)
    assert nothing.returncode == 2 and "line 1: not valid JSON" in nothing.stderr
    assert "holds no request" in nothing.stderr
    assert httpx.get(second.url + "/health").status_code == 200
