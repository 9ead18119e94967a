"""The serving half of bench_pd: one-launch P/D (1 prefill + 1 decode replica) against a
colocated engine (one replica with the same total threads: the thread policy splits the cores
between the ranks of a launch), one after the other, on a window of a real trace.

    python tools/bench/pd.py serving --trace ../shared/traces/mooncake_fast25_conversation.jsonl \\
        --window 0:30 --input-scale 16

Both run the same requests through our replay client (streamed completions of token-id prompts,
greedy, EOS ignored), from the trace's arrival times. Printed: the figures of each (req/s, output
tok/s, TTFT, TPOT, ITL), the ratio disaggregated / colocated of ITL p99 (the target is <= 0.5),
and how many requests got identical text from both.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import sys
import tempfile
from pathlib import Path

from engine.bench.figures import Figures, render, summarize
from engine.bench.loads import trace_load, warmup_load
from engine.client.servers import ServerFailed, engine_server, served_model
from engine.trace.client import ClientOptions, ReplayResult, replay
from engine.trace.schedule import build_schedule

SETUPS = {  # in this order: the ratio rows read disaggregated / colocated
    "disaggregated": ["--prefill-replicas", "1", "--decode-replicas", "1"],
    "colocated": [],
}


def run_setup(
    name: str, model: str, args: argparse.Namespace
) -> tuple[Figures, list[ReplayResult]]:
    load = trace_load(args)
    logs = Path(tempfile.mkdtemp(prefix=f"bench-pd-{name}-"))
    extra = [*SETUPS[name], *shlex.split(args.engine_args)]
    with engine_server(model, logs, extra, args.start_timeout) as url:
        served = served_model(url)
        options = ClientOptions(url, timeout=args.request_timeout)
        warm = build_schedule(warmup_load().entries, speed=float("inf"), model=served)
        asyncio.run(replay(warm, options))
        print(f"bench_pd: {name}, {len(load.entries)} requests", file=sys.stderr)
        schedule = build_schedule(load.entries, speed=load.speed, model=served)
        results = asyncio.run(replay(schedule, options))
    shutil.rmtree(logs)
    figures = summarize(name, "trace", results)
    figures.server = name
    return figures, results


def identical_outputs(a: list[ReplayResult], b: list[ReplayResult]) -> tuple[int, int]:
    """(requests whose every choice's text is the same in both runs, requests compared)."""
    by_position = {r.request.position: r for r in b}
    same = 0
    for result in a:
        other = by_position.get(result.request.position)
        if other is None or not (result.ok and other.ok):
            continue
        texts = {i: c.text for i, c in result.choices.items()}
        same += texts == {i: c.text for i, c in other.choices.items()}
    return same, len(a)


def serving(args: argparse.Namespace) -> int:
    from engine.launch.model_source import model_directory
    from engine.settings.home import default_engine_home

    model, _ = model_directory(args.model, default_engine_home())
    figures: list[Figures] = []
    results: list[list[ReplayResult]] = []
    for name in SETUPS:
        try:
            setup_figures, setup_results = run_setup(name, model, args)
        except ServerFailed as e:
            print(f"bench_pd: {e}", file=sys.stderr)
            return 1
        figures.append(setup_figures)
        results.append(setup_results)
    describe = (
        f"{args.trace}, window {args.window[0]:g}-{args.window[1]:g} s, inputs / "
        f"{args.input_scale:g}, speed {args.speed:g}x; {model}"
    )
    print(render(describe, figures))
    disaggregated, colocated = figures
    if colocated.itl_p99_ms and disaggregated.itl_p99_ms:
        ratio = disaggregated.itl_p99_ms / colocated.itl_p99_ms
        print(f"ITL p99 disaggregated / colocated: {ratio:.2f} (target <= 0.5)")
    same, total = identical_outputs(results[0], results[1])
    print(f"identical outputs: {same} of {total} requests")
    return 0 if all(f.ok == f.requests for f in figures) and same == total else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="checkpoint directory, .gguf file or 'demo' (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--trace",
        default=str(Path(__file__).parents[3] / "shared/traces/mooncake_fast25_conversation.jsonl"),
    )
    p.add_argument("--window", type=_window, default=(0.0, 30.0), help="SECONDS or START:END")
    p.add_argument("--input-scale", type=float, default=16.0, help="divide input lengths by this")
    p.add_argument("--max-output", type=int, default=128, help="cap output lengths")
    p.add_argument("--speed", type=float, default=1.0, help="divide inter-arrival times by this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-args", default="", help="more flags for both launches")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)


def _window(text: str) -> tuple[float, float]:
    start, _, end = text.rpartition(":")
    return (float(start) if start else 0.0, float(end))
