"""The root's own death, with the test acting as systemd: a fake $NOTIFY_SOCKET (a datagram socket
read here) gets READY=1 and WATCHDOG=1 pings; the pidfile refuses a second root; a root SIGKILLed
mid-stream is started again (Restart=on-failure) and takes over the pidfile its predecessor left,
its actors died with it, the new run sweeps the shared memory the dead one left, and a client
that retries with the same X-Request-Id is answered: the same greedy tokens, from the start.
What the root held in memory is lost with it: the cut stream is not resumed. The prefix cache's
disk tier is not (issue 50): a 4,000-token prompt the dead root served computes only its last
partial block in the new run, the rest read from disk, and gives the same greedy tokens."""

from __future__ import annotations

import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import server_args, without_api_key
from tests.e2e.harness import (
    API_KEY,
    REPO,
    Server,
    leftover_ipc,
    start_server,
    wait_until,
)
from tests.hf_reference import TIE_TOLERANCE
from tests.holds import HOLD_TEXT, hold_env
from tests.integration.test_fault_tolerance import alive, children_of

WATCHDOG_USEC = 400_000  # pings every 0.2 s
LONG_PROMPT = [3 + (i * 7919) % 500 for i in range(4000)]
REUSABLE = (4000 - 1) // 16 * 16  # full blocks: the last token always runs through the model
REQUEST_ID = "retry-after-root-death"
# Held (tests/holds.py): 4 s of tokens on any machine, so the root dies before they are all made.
MAX_TOKENS = 200


class FakeSystemd:
    """A $NOTIFY_SOCKET read all along, as systemd reads it (its queue never fills)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.1)
        self._messages: queue.Queue[dict[str, str]] = queue.Queue()
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                data = self._sock.recv(4096)
            except TimeoutError:
                continue
            self._messages.put(dict(line.split("=", 1) for line in data.decode().splitlines()))

    def next_message(self, wanted: str) -> dict[str, str]:
        """The next message that carries `wanted` (KEY=value lines as a dict)."""
        deadline = time.monotonic() + 60.0
        while (left := deadline - time.monotonic()) > 0:
            try:
                fields = self._messages.get(timeout=left)
            except queue.Empty:
                break
            if wanted in fields:
                return fields
        raise AssertionError(f"no {wanted} within 60 s")

    def forget_messages(self) -> None:
        """Drop what came so far (a dead root's pings)."""
        while not self._messages.empty():
            self._messages.get_nowait()

    def close(self) -> None:
        self._stop.set()
        self._reader.join(10)
        self._sock.close()


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[FakeSystemd]:
    fake = FakeSystemd(tmp_path / "notify.sock")
    try:
        yield fake
    finally:
        fake.close()


def first_kill(server: Server) -> bool:
    return server.proc.poll() is None


def stream(server: Server, body: dict[str, object], kill_root_after: int = 0) -> list[str]:
    """The streamed tokens; with `kill_root_after`, the root is SIGKILLed once that many have
    come, and the tokens the cut stream delivered are returned."""
    tokens: list[str] = []
    headers = {"Authorization": f"Bearer {API_KEY}", "X-Request-Id": REQUEST_ID}
    url = server.url + "/v1/completions"
    finished = False
    try:
        with httpx.stream("POST", url, json=body, headers=headers, timeout=60.0) as reply:
            assert reply.status_code == 200, reply.read()
            assert reply.headers["x-request-id"] == REQUEST_ID
            for line in reply.iter_lines():
                finished = finished or line == "data: [DONE]"
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: ") :])
                assert event["id"] == f"cmpl-{REQUEST_ID}"
                tokens += event["choices"][0]["logprobs"]["tokens"]
                if kill_root_after and len(tokens) >= kill_root_after and first_kill(server):
                    server.proc.send_signal(signal.SIGKILL)
    except httpx.RemoteProtocolError:
        assert kill_root_after, "only the root's death may cut the stream"
    assert finished != bool(kill_root_after)
    return tokens


def long_prompt(server: Server) -> tuple[list[int], list[float], int]:
    """LONG_PROMPT's greedy tokens, the gap between the top two logprobs at each, and the prompt
    tokens that came from a cache."""
    body = {
        "model": server.model,
        "prompt": LONG_PROMPT,
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "logprobs": 5,
    }
    with server.http(timeout=600.0) as client:
        reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    # Two tokens of one text share an entry: a gap not seen is taken for a tie.
    tops = [sorted(top.values()) for top in answer["choices"][0]["logprobs"]["top_logprobs"]]
    gaps = [top[-1] - top[-2] if len(top) > 1 else 0.0 for top in tops]
    return (
        answer["choices"][0]["token_ids"],
        gaps,
        answer["usage"]["prompt_tokens_details"]["cached_tokens"],
    )


def all_written(server: Server) -> bool:
    stats = server.admin("stats")
    return (
        stats["kv_disk_written_blocks"] >= REUSABLE // 16 and not stats["kv_disk_unwritten_blocks"]
    )


def test_a_root_killed_mid_stream_is_restarted_and_a_retry_with_its_id_is_answered(
    model_args: list[str], tmp_path: Path, systemd: FakeSystemd
) -> None:
    pidfile = tmp_path / "engine.pid"
    args = server_args(
        model_args,
        None,
        "--server.pidfile",
        str(pidfile),
        "--max-model-len",
        "4096",
        "--kv-disk-path",
        str(tmp_path / "kv-disk"),
    )
    env = {"NOTIFY_SOCKET": str(systemd.path), "WATCHDOG_USEC": str(WATCHDOG_USEC), **hold_env()}
    body = {
        "model": "m",
        "prompt": "the root dies while this streams" + HOLD_TEXT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "logprobs": 0,
    }
    first = start_server(args, tmp_path, env, name="first")
    try:
        body["model"] = first.model
        ready = systemd.next_message("READY")
        assert ready["MAINPID"] == str(first.pid) and ready["STATUS"].startswith("serving http")
        systemd.next_message("WATCHDOG")
        assert pidfile.read_text().strip() == str(first.pid)
        refused = subprocess.run(
            [sys.executable, "-m", "engine", *without_api_key(args)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode == 1
        assert refused.stderr.strip() == (
            f"engine: pidfile {pidfile} is held by another engine (pid {first.pid}); "
            "stop it or choose another server.pidfile"
        )
        actors = children_of(first.pid)
        assert actors
        cold, gaps, cached = long_prompt(first)
        assert cached == 0
        wait_until(lambda: all_written(first), timeout=60.0)
        seen = stream(first, body, kill_root_after=4)
        assert first.proc.wait(10) == -signal.SIGKILL
    finally:
        first.stop()
    wait_until(lambda: not any(alive(pid) for pid in actors), timeout=30.0)

    systemd.forget_messages()
    second = start_server(args, tmp_path, env, name="second")  # Restart=on-failure
    try:
        assert systemd.next_message("READY")["MAINPID"] == str(second.pid)
        assert pidfile.read_text().strip() == str(second.pid)
        assert leftover_ipc(first.pid) == []  # the dead run's segments: swept at a start
        answer = stream(second, body)  # the client's retry, with the same X-Request-Id
        assert len(seen) < len(answer) == MAX_TOKENS and answer[: len(seen)] == seen
        warm, _, cached = long_prompt(second)
        assert cached == REUSABLE
        # Counted when read, reported a moment later (the retry's prompt had a block on disk too).
        wait_until(lambda: second.admin("stats")["kv_disk_hit_blocks"] >= REUSABLE // 16, 30.0)
        assert second.admin("stats")["kv_disk_dropped_blocks"] == 0
        # The same greedy tokens, up to a tie (the last block's query ran in another batch).
        same = next(
            (i for i, (a, b) in enumerate(zip(cold, warm, strict=True)) if a != b), len(cold)
        )
        assert same == len(cold) or gaps[same] <= TIE_TOLERANCE, (cold, warm, gaps)
    finally:
        status = second.stop()
    assert status == 0, second.log()
    assert systemd.next_message("STOPPING")["STOPPING"] == "1"
    assert not pidfile.exists(), second.log()  # an orderly exit removes it
