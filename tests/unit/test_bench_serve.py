"""engine/bench/ (`engine bench serve`, and tools/bench/serving.py over it): the figures it
derives from replay results and from the engine's /metrics, the direction of its ratios and a
ratio row per peer, its loads and its argument parsing."""

from __future__ import annotations

import argparse
import re

import pytest

from engine.bench.engine_steps import EngineSteps, engine_steps, parse_metrics
from engine.bench.figures import (
    Figures,
    ratios,
    render,
    round_label,
    round_ranges,
    summarize,
)
from engine.bench.loads import _counts, _rates, _window, loads_of
from engine.trace.client import ReplayResult
from engine.trace.schedule import ScheduledRequest


def _result(sent: float, ttft: float, end: float, tokens: int, itls: list[float]) -> ReplayResult:
    request = ScheduledRequest(0, None, 0.0, "/v1/completions", {})  # type: ignore[arg-type]
    return ReplayResult(
        request,
        sent_at=sent,
        finished_at=end,
        status=200,
        ttft=ttft,
        itls=itls,
        completion_tokens=tokens,
    )


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


def _figures(server: str, scale: float, load: str = "inf") -> Figures:
    """Throughput divided by `scale`, latencies multiplied by it."""
    return Figures(
        server,
        load,
        8,
        8,
        4.0 / scale,
        400.0 / scale,
        50.0 * scale,
        90.0 * scale,
        10.0 * scale,
        20.0 * scale,
        5.0 * scale,
        30.0 * scale,
        None,
    )


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


def test_each_peer_gets_a_ratio_row_against_the_engine_for_each_load() -> None:
    figures = [
        _figures(server, scale, load)
        for load in ("1 stream", "4/s")
        for server, scale in (("engine", 1.0), ("llama.cpp", 2.0), ("vLLM (float32)", 4.0))
    ]
    cells = [re.split(r"\s{2,}", line.strip()) for line in render("w", figures).splitlines()[4:]]
    assert [row[:2] for row in cells] == [
        [server, load]
        for load in ("1 stream", "4/s")
        for server in (
            "engine",
            "llama.cpp",
            "vLLM (float32)",
            "ratio vs llama.cpp",
            "ratio vs vLLM (float32)",
        )
    ]
    ratio_rows = [row[2:] for row in cells if row[0].startswith("ratio")]
    assert ratio_rows == [["2.00x"] * 8, ["4.00x"] * 8] * 2


def test_rounds_give_a_ratio_each_and_their_range_per_peer_and_load() -> None:
    # Round 2 ran in the reverse order (the peer first): pairs still match by load and round.
    figures = [
        _figures("engine", 1.0, round_label("8 streams", 1, 2)),
        _figures("llamacpp", 2.0, round_label("8 streams", 1, 2)),
        _figures("llamacpp", 3.0, round_label("8 streams", 2, 2)),
        _figures("engine", 1.0, round_label("8 streams", 2, 2)),
    ]
    ranges = round_ranges(figures)["llama.cpp"]["8 streams"]
    assert ranges == {"output_tokens_per_s": [2.0, 3.0], "tpot_p50_ms": [2.0, 3.0]}
    assert render("w", figures).splitlines()[-1] == (
        "ratio vs llama.cpp, 8 streams, over the rounds: out tok/s 2.00-3.00x, TPOT p50 2.00-3.00x"
    )
    one_round = [
        _figures(server, 1.0, round_label("8 streams", 1, 1)) for server in ("engine", "vllm")
    ]
    assert one_round[0].load == "8 streams" and round_ranges(one_round) == {}


# What the engine's GET /metrics says (prometheus_client's text format), before and after a load
METRICS_BEFORE = """\
# HELP engine:steps_total Model steps run
# TYPE engine:steps_total counter
engine:steps_total{model_name="m"} 100.0
# HELP engine:step_compute_seconds_total Seconds rank 0 spent computing steps
# TYPE engine:step_compute_seconds_total counter
engine:step_compute_seconds_total{model_name="m"} 2.0
# HELP engine:step_gaps_total Gaps between two steps of a running batch
# TYPE engine:step_gaps_total counter
engine:step_gaps_total{model_name="m"} 90.0
# HELP engine:step_gap_seconds_total Seconds the workers waited in those gaps
# TYPE engine:step_gap_seconds_total counter
engine:step_gap_seconds_total{model_name="m"} 0.5
# HELP engine:actor_cpu_seconds_total CPU seconds of each actor's current process
# TYPE engine:actor_cpu_seconds_total counter
engine:actor_cpu_seconds_total{actor="worker",model_name="m"} 10.0
engine:actor_cpu_seconds_total{actor="root",model_name="m"} 3.0
# HELP engine:num_requests_running Requests running
# TYPE engine:num_requests_running gauge
engine:num_requests_running{model_name="m"} 0.0
"""
METRICS_AFTER = (
    METRICS_BEFORE.replace("} 100.0", "} 300.0")  # 200 steps
    .replace("} 2.0", "} 7.0")  # 5 s of compute: 25 ms a step
    .replace("} 90.0", "} 280.0")  # 190 gaps
    .replace("} 0.5", "} 0.88")  # 0.38 s in gaps: 2 ms each
    .replace('"m"} 10.0', '"m"} 19.0')  # worker: 9 s of CPU in 10 s
    .replace('"m"} 3.0', '"m"} 5.0')  # root: 2 s
    + 'engine:actor_cpu_seconds_total{actor="scheduler",model_name="m"} 0.5\n'  # new: from 0
)


def test_engine_figures_are_the_deltas_of_its_metrics_over_the_load() -> None:
    before, after = parse_metrics(METRICS_BEFORE), parse_metrics(METRICS_AFTER)
    assert before["engine:steps_total", ""] == 100.0
    assert before["engine:actor_cpu_seconds_total", "worker"] == 10.0
    steps = engine_steps("16 streams", before, after, wall_s=10.0, output_tokens=1000)
    assert steps.steps == 200.0 and steps.gaps == 190.0
    assert steps.compute_ms_per_step == pytest.approx(25.0)
    assert steps.compute_share == pytest.approx(0.5)
    assert steps.gap_ms == pytest.approx(2.0)
    assert steps.tokens_per_compute_s == pytest.approx(200.0)
    assert steps.actor_cpu_percent == pytest.approx(
        {"root": 20.0, "scheduler": 5.0, "worker": 90.0}
    )
    assert list(steps.actor_cpu_percent) == ["root", "scheduler", "worker"]  # the actors' order
    # the scheduler's part of the gaps is not exported here: no figure, and a dash for it
    assert steps.gap_scheduler_ms is None
    table = render("workload", [_figures("engine", 1.0, "16 streams")], [steps])
    row = next(line for line in table.splitlines()[-3:] if line.startswith("16 streams"))
    assert row.split()[2:9] == ["200", "25.0", "50%", "190", "2.00", "—", "200.0"]
    assert row.endswith("root 20, scheduler 5, worker 90")


def test_an_engine_without_step_metrics_gives_dashes_not_an_error() -> None:
    assert parse_metrics("not a metrics text {") == {}
    steps = engine_steps("1 stream", {}, parse_metrics("# nothing\n"), 3.0, 100)
    assert steps == EngineSteps("1 stream", 3.0, *[None] * 7)
    row = render("w", [_figures("engine", 1.0, "1 stream")], [steps]).splitlines()[-1]
    assert row.split() == ["1", "stream", *["—"] * 7, "—"]


def test_stream_loads_are_closed_loops_and_no_load_shares_a_prompt_with_another() -> None:
    args = argparse.Namespace(
        streams=[1, 4],
        streams_requests=2,
        rates=[4.0, float("inf")],
        num_requests=3,
        input_len=40,
        output_len=5,
        seed=0,
    )
    loads = loads_of(args)
    assert [(x.label, x.streams, len(x.entries)) for x in loads] == [
        ("1 stream", 1, 2),
        ("4 streams", 4, 8),
        ("4/s", None, 3),
        ("inf", None, 3),
    ]
    assert [x.speed for x in loads] == [float("inf"), float("inf"), 1.0, float("inf")]
    assert all(
        e.body["max_tokens"] == 5 and len(e.body["prompt"]) == 40 for x in loads for e in x.entries
    )
    starts = [tuple(e.body["prompt"][:16]) for x in loads for e in x.entries]
    assert len(set(starts)) == len(starts)


def test_stream_counts_parse_or_are_refused_with_the_text() -> None:
    assert _counts("1,4,16,64", "stream counts") == [1, 4, 16, 64]
    assert _counts("none", "stream counts") == [] and _rates("none") == []
    for bad in ("0", "1,x", "2.5"):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            _counts(bad, "stream counts")
