"""`engine bench serve`: online serving measured from outside, as vLLM's `vllm bench serve`.

    engine bench serve                          # the default model: 1, 4, 16, 64 streams, 1 req/s
    engine bench serve --model demo --streams 1,4 --rates 4,inf --num-requests 16 \\
        --input-len 64 --output-len 16
    engine bench serve --url http://127.0.0.1:8000 --streams 8 --rates none   # a running server
    engine bench serve --trace mooncake.jsonl --window 40 --input-scale 32

The engine is started on 127.0.0.1 at a free port (or --url names a server already running: any
OpenAI-compatible one), warmed up with two short requests, and given each load in turn: for each
N of --streams, a closed loop of N streams each sending --requests-per-stream requests back to
back; for each rate of --rates, Poisson arrivals (`inf`: all at once); or, with --trace, a time
window of a trace (Mooncake JSONL or Azure CSV, inputs divided by --input-scale, arrival times
kept). Requests go through the replay client (engine/trace/client.py): streamed completions of
token-id prompts, greedy, EOS ignored, so every output is exactly as long as asked.

Printed: one row per load: requests served, req/s, output tok/s, TTFT p50 / p99, TPOT p50 / p99
(per request: (end - first token) / (tokens - 1)), ITL p50 / p99; then the engine's own figures
from its GET /metrics before and after each load (steps, compute per step and its share of the
time, the gaps between two steps of a running batch and the scheduler's part, tokens per compute
second, each actor's CPU). --json: one object instead. tools/bench/serving.py runs the same code
with llama.cpp's and vLLM's servers after the engine's, and a ratio row per peer. Exit status 1
when a server fails to start or a request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

from engine.bench.engine_steps import EngineSteps, engine_steps, settled_scrape
from engine.bench.figures import (
    Figures,
    ratio_pairs,
    ratios,
    render,
    round_label,
    round_ranges,
    summarize,
)
from engine.bench.loads import (
    Load,
    add_load_arguments,
    check_load_arguments,
    describe_loads,
    loads_of,
    trace_load,
    warmup_load,
)
from engine.client.servers import ServerFailed, engine_server, served_model
from engine.trace.client import ClientOptions, ReplayResult, replay
from engine.trace.schedule import build_schedule

Server = Callable[[], contextlib.AbstractContextManager[str]]  # yields the server's URL


def measure(
    server: str, url: str, loads: list[Load], args: argparse.Namespace, engine: bool = False
) -> tuple[list[Figures], list[EngineSteps]]:
    """Every load on the server at `url`; with `engine`, also its /metrics around each load."""
    model = served_model(url)

    def run(load: Load) -> list[ReplayResult]:
        schedule = build_schedule(load.entries, speed=load.speed, model=model)
        options = ClientOptions(url, max_concurrency=load.streams, timeout=args.request_timeout)
        return asyncio.run(replay(schedule, options))

    run(warmup_load())
    figures, steps = [], []
    counters = settled_scrape(url) if engine else {}
    for load in loads:
        print(f"bench serve: {server}, {load.label}, {len(load.entries)} requests", file=sys.stderr)
        start = time.monotonic()
        results = run(load)
        wall = time.monotonic() - start
        figures.append(summarize(server, load.label, results))
        if engine:
            before, counters = counters, settled_scrape(url)
            tokens = sum(r.completion_tokens for r in results if r.ok)
            steps.append(engine_steps(load.label, before, counters, wall, tokens))
    return figures, steps


def run_servers(
    args: argparse.Namespace, loads: list[Load], servers: dict[str, Server], describe: str
) -> int:
    """Each server in turn (never two running), every load on each; the table or JSON printed.
    The server named "engine" comes first: its /metrics are read and the others' ratios are
    against it. With --rounds N above 1, all that N times, every other round in the reverse order
    (so that neither side always runs on the machine the other left), each load's label naming
    its round ("1 stream #2"): a ratio per round, and their ranges under the table."""
    figures: list[Figures] = []
    steps: list[EngineSteps] = []
    rounds = getattr(args, "rounds", 1)
    for number in range(1, rounds + 1):
        order = list(servers.items())[:: 1 if number % 2 else -1]
        labelled = [replace(load, label=round_label(load.label, number, rounds)) for load in loads]
        for name, start in order:
            try:
                with start() as url:
                    found = measure(name, url, labelled, args, name == "engine")
            except ServerFailed as e:
                print(f"bench serve: {e}", file=sys.stderr)  # its log is kept
                return 1
            figures += found[0]
            steps += found[1]
    if args.json:
        by_peer: dict[str, dict[str, dict[str, float | None]]] = {}
        for ours, peer in ratio_pairs(figures):
            by_peer.setdefault(peer.server, {})[ours.load] = ratios(ours, peer)
        report = {
            "workload": describe,
            "figures": [asdict(f) for f in figures],
            "ratios": by_peer,
            "ratio_ranges": round_ranges(figures),
            "engine_steps": [asdict(s) for s in steps],
        }
        print(json.dumps(report))
    else:
        print(render(describe, figures, steps))
    return 0 if all(f.ok == f.requests for f in figures) else 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The loads, the engine's launch and the output: what the tool with peers shares."""
    add_load_arguments(p)
    p.add_argument(
        "--engine-args",
        default="",
        help="more flags for `engine serve`, e.g. --engine-args='--max-num-seqs 64'",
    )
    p.add_argument(
        "--rounds",
        type=_rounds,
        default=1,
        help="run every server this many times, alternating their order (default 1)",
    )
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds per server start")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")


def _rounds(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a number of rounds >= 1, got {text!r}")
    return int(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="engine bench serve", description=__doc__.split("\n")[0] if __doc__ else None
    )
    p.add_argument(
        "--model",
        help="what `engine serve` serves: a checkpoint directory, a .gguf file or 'demo' "
        "(default: the default model)",
    )
    p.add_argument("--url", help="measure the server running at this URL instead of starting one")
    add_arguments(p)
    args = p.parse_args(argv)
    check_load_arguments(p, args)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    loads = [trace_load(args)] if args.trace else loads_of(args)
    if args.url:
        describe = f"{describe_loads(args, loads)}; the server at {args.url}"
        url: str = args.url.rstrip("/")
        return run_servers(args, loads, {"engine": lambda: contextlib.nullcontext(url)}, describe)
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as logs:
        extra = shlex.split(args.engine_args)
        start = partial(engine_server, args.model, Path(logs), extra, args.start_timeout)
        describe = f"{describe_loads(args, loads)}; the engine serves {args.model or 'its default'}"
        status = run_servers(args, loads, {"engine": start}, describe)
        if status:
            print(f"bench serve: the engine's log: {Path(logs) / 'engine.log'}", file=sys.stderr)
            print(Path(logs, "engine.log").read_text(errors="replace")[-3000:], file=sys.stderr)
        return status
