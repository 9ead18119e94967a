"""tools/bench_serving.py: the figures it derives from replay results, the direction of its
ratios, its argument parsing, and that stopping a server leaves nothing of it behind."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from bench_serving import Figures, _rates, _window, ratios, summarize
from serving_servers import stop_server

from engine.trace.client import ReplayResult
from engine.trace.schedule import ScheduledRequest


def _result(sent: float, ttft: float, end: float, tokens: int, itls: list[float]) -> ReplayResult:
    request = ScheduledRequest(0, None, 0.0, "/v1/completions", {})  # type: ignore[arg-type]
    return ReplayResult(
        request, sent_at=sent, finished_at=end, status=200, ttft=ttft, itls=itls,
        completion_tokens=tokens,
    )  # fmt: skip


def test_tpot_is_the_time_after_the_first_token_per_later_token() -> None:
    results = [
        _result(0.0, 0.1, 1.0, 10, [0.1] * 9),  # 0.9 s for 9 more tokens: 100 ms each
        _result(0.5, 0.2, 1.1, 4, [0.1, 0.1, 0.2]),  # 0.4 s for 3 more: 133.3 ms each
        _result(0.6, 0.3, 0.9, 1, []),  # one token: no TPOT
    ]
    figures = summarize("engine", "inf", results)
    assert figures.ok == 3 and figures.first_error is None
    assert figures.tpot_p50_ms == pytest.approx((100.0 + 400.0 / 3) / 2)
    assert figures.ttft_p50_ms == pytest.approx(200.0)
    # 12 gaps, eleven of 100 ms and one of 200 ms: p99 sits 0.89 of the way from 100 to 200
    assert figures.itl_p50_ms == pytest.approx(100.0)
    assert figures.itl_p99_ms == pytest.approx(189.0)
    assert figures.requests_per_s == pytest.approx(3 / 1.1)  # first sent at 0, last done at 1.1
    assert figures.output_tokens_per_s == pytest.approx(15 / 1.1)


def test_a_failed_request_is_counted_and_its_error_kept() -> None:
    failed = _result(0.0, 0.1, 0.2, 0, [])
    failed.status, failed.error = 400, "HTTP 400: prompt too long"
    figures = summarize("vllm", "2/s", [_result(0.0, 0.1, 1.0, 10, [0.1] * 9), failed])
    assert (figures.requests, figures.ok) == (2, 1)
    assert figures.first_error == "HTTP 400: prompt too long"


def _figures(server: str, scale: float) -> Figures:
    """Throughput divided by `scale`, latencies multiplied by it."""
    return Figures(server, "inf", 8, 8, 4.0 / scale, 400.0 / scale, 50.0 * scale, 90.0 * scale,
                   10.0 * scale, 20.0 * scale, 5.0 * scale, 30.0 * scale, None)  # fmt: skip


def test_ratios_above_one_mean_the_engine_is_better_in_every_column() -> None:
    assert all(
        r == pytest.approx(2.0)
        for r in ratios(_figures("engine", 1.0), _figures("vllm", 2.0)).values()
    )
    assert all(
        r == pytest.approx(0.5)
        for r in ratios(_figures("engine", 2.0), _figures("vllm", 1.0)).values()
    )


def test_a_missing_figure_gives_no_ratio() -> None:
    ours = _figures("engine", 1.0)
    ours.tpot_p50_ms = None  # every request produced one token
    assert ratios(ours, _figures("vllm", 1.0))["tpot_p50_ms"] is None


def test_rates_and_windows_parse_or_are_refused_with_the_text() -> None:
    assert _rates("2,4,inf") == [2.0, 4.0, float("inf")]
    assert _window("40") == (0.0, 40.0)
    assert _window("10:20") == (10.0, 20.0)
    for bad in ("2,0", "x", "4,-1"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            _rates(bad)
    for bad in ("20:10", "0", "a:b"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            _window(bad)


def test_stopping_a_server_also_ends_what_it_left_in_its_session(tmp_path: Path) -> None:
    """A server whose child ignores SIGTERM and outlives it (as an actor or vLLM's engine core
    might): the child is killed once the grace time is over."""
    pid_file = tmp_path / "child.pid"
    script = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the server did not start its child"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    try:
        stop_server(proc, timeout=2.0)
        assert proc.returncode is not None
        assert _gone(lambda: os.kill(child, 0), timeout=10.0)  # killed, then reaped by init
        assert _gone(lambda: os.killpg(proc.pid, 0), timeout=10.0)  # nothing else in its session
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def _gone(probe: Callable[[], None], timeout: float) -> bool:
    """Whether `probe` (a signal 0) finds nothing within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            probe()
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
