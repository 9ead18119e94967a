"""A serving benchmark's loads: closed loops of N streams, Poisson arrivals at given rates, or a
time window of a public trace; each with prompts of its own, so none hits the prefix cache another
one filled. Also their command-line arguments."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from engine.trace.format import TraceEntry
from engine.trace.importers import (
    MOONCAKE_BLOCK_TOKENS,
    ImportOptions,
    ImportResult,
    TraceImportError,
    import_azure,
    import_mooncake,
    poisson_workload,
)
from engine.trace.synth import PromptSynth


@dataclass(frozen=True)
class Load:
    label: str  # "16 streams", "4/s", "inf", "trace"
    speed: float  # divides the arrival times (inf: all at once)
    entries: list[TraceEntry]
    streams: int | None = None  # a closed loop: at most this many requests in flight


def loads_of(args: argparse.Namespace) -> list[Load]:
    """--streams' closed loops, then --rates' Poisson loads, each with prompts of its own (its
    own seed), so no load reuses prefixes another one left in the cache."""
    loads = []
    for i, streams in enumerate(args.streams):
        workload = _workload(args, args.streams_requests * streams, 1.0, args.seed + 1 + i)
        label = f"{streams} stream{'s' if streams > 1 else ''}"
        loads.append(Load(label, math.inf, _entries(workload), streams))
    for i, rate in enumerate(args.rates):
        seed = args.seed + 1 + len(args.streams) + i
        workload = _workload(args, args.num_requests, rate if math.isfinite(rate) else 1.0, seed)
        label = f"{rate:g}/s" if math.isfinite(rate) else "inf"
        loads.append(Load(label, 1.0 if math.isfinite(rate) else math.inf, _entries(workload)))
    return loads


def _workload(args: argparse.Namespace, num: int, rate: float, seed: int) -> ImportResult:
    options = ImportOptions(synth=PromptSynth(MOONCAKE_BLOCK_TOKENS, seed=seed))
    return poisson_workload(
        rate=rate,
        num=num,
        input_len=args.input_len,
        output_len=args.output_len,
        options=options,
        seed=seed,
    )


def trace_load(args: argparse.Namespace) -> Load:
    """The trace's window, inputs divided by --input-scale (Mooncake: its 512-token blocks too,
    so equal hash ids still make equal prefixes), arrival times and output lengths kept."""
    block = max(1, round(MOONCAKE_BLOCK_TOKENS / args.input_scale))
    options = ImportOptions(
        synth=PromptSynth(block, seed=args.seed),
        input_scale=block / MOONCAKE_BLOCK_TOKENS,
        max_output=args.max_output,
        window=args.window,
    )
    importer = import_azure if args.trace.endswith(".csv") else import_mooncake
    try:
        result = importer(args.trace, options)
    except TraceImportError as e:
        raise SystemExit(f"bench serve: {e}") from None
    if result.problems:
        print(
            f"bench serve: {args.trace}: {len(result.problems)} malformed rows skipped "
            f"(first: {result.problems[0]})",
            file=sys.stderr,
        )
    if not result.records:
        raise SystemExit(f"bench serve: {args.trace} has no request in the window {args.window}")
    return Load("trace", args.speed, _entries(result))


def _entries(result: ImportResult) -> list[TraceEntry]:
    return [TraceEntry(i + 1, r, r.request_body()) for i, r in enumerate(result.records)]


def slot_context(loads: list[Load]) -> int:
    """Tokens of KV cache a llama-server slot needs for the longest request, in 256s."""
    longest = max(
        len(e.body["prompt"]) + int(e.body["max_tokens"]) for load in loads for e in load.entries
    )
    return -(-longest // 256) * 256


def warmup_load() -> Load:
    options = ImportOptions(synth=PromptSynth(MOONCAKE_BLOCK_TOKENS, seed=-1))
    workload = poisson_workload(rate=1.0, num=2, input_len=16, output_len=4, options=options)
    return Load("warm-up", math.inf, _entries(workload))


def describe_loads(args: argparse.Namespace, loads: list[Load]) -> str:
    if args.trace:
        return (
            f"{args.trace}, window {args.window[0]:g}-{args.window[1]:g} s, inputs ÷ "
            f"{args.input_scale:g}, speed {args.speed:g}x"
        )
    parts = []
    if args.streams:
        counts = ", ".join(str(n) for n in args.streams)
        each = f"{args.streams_requests} request{'s' if args.streams_requests > 1 else ''} each"
        parts.append(f"closed loop at {counts} streams, {each}")
    if args.rates:
        parts.append(f"Poisson, {args.num_requests} requests per rate")
    return f"{'; '.join(parts)}; {args.input_len} in / {args.output_len} out, greedy, EOS ignored"


def add_load_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--streams",
        type=lambda text: _counts(text, "stream counts"),
        default=[1, 4, 16, 64],
        help="closed-loop loads: this many concurrent streams each, comma-separated; none: no "
        "such load (default 1,4,16,64)",
    )
    p.add_argument(
        "--requests-per-stream",
        dest="streams_requests",
        type=int,
        default=2,
        help="requests each stream sends back to back (default 2)",
    )
    p.add_argument(
        "--rates",
        type=_rates,
        default=[1.0],
        help="Poisson request rates per second, comma-separated; inf = all at once; none: no "
        "such load (default 1: about what this model serves on 2 cores at 256 / 128)",
    )
    p.add_argument("--num-requests", type=int, default=32, help="requests per rate (default 32)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--trace", help="replay this trace instead (Mooncake .jsonl or Azure .csv)")
    p.add_argument(
        "--window",
        type=_window,
        default=(0.0, 60.0),
        help="with --trace: SECONDS (from the start) or START:END (default 60)",
    )
    p.add_argument(
        "--input-scale",
        type=float,
        default=32.0,
        help="with --trace: divide input lengths by this (default 32)",
    )
    p.add_argument("--max-output", type=int, default=None, help="with --trace: cap outputs")
    p.add_argument(
        "--speed", type=float, default=1.0, help="with --trace: divide inter-arrival times by this"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")


def check_load_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (p.error: usage, exit 2) what add_load_arguments' types cannot check alone."""
    for name in ("num_requests", "input_len", "output_len", "streams_requests"):
        if getattr(args, name) < 1:
            flag = {"streams_requests": "requests-per-stream"}.get(name, name.replace("_", "-"))
            p.error(f"--{flag} must be >= 1, got {getattr(args, name)}")
    if not args.input_scale > 0 or not args.speed > 0:
        p.error("--input-scale and --speed must be > 0")
    if not args.trace and not args.streams and not args.rates:
        p.error("nothing to run: --streams and --rates are both none")


def _counts(text: str, what: str) -> list[int]:
    if text.strip() == "none":
        return []
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = []
    if not counts or not all(n >= 1 for n in counts):
        raise argparse.ArgumentTypeError(f"expected {what} >= 1 like 1,4,16, got {text!r}")
    return counts


def _rates(text: str) -> list[float]:
    if text.strip() == "none":
        return []
    try:
        rates = [float(part) for part in text.split(",")]
    except ValueError:
        rates = []
    if not rates or not all(r > 0 for r in rates):
        raise argparse.ArgumentTypeError(f"expected rates > 0 like 2,4,6,inf, got {text!r}")
    return rates


def _window(text: str) -> tuple[float, float]:
    start, _, end = text.rpartition(":") if ":" in text else ("0", ":", text)
    try:
        window = (float(start), float(end))
    except ValueError:
        window = (0.0, -1.0)
    if not 0 <= window[0] < window[1]:
        raise argparse.ArgumentTypeError(
            f"expected SECONDS or START:END (0 <= START < END), got {text!r}"
        )
    return window
