"""Online serving: our server and a peer's (vLLM or llama.cpp), one after the other, one workload.

    python tools/bench_serving.py --rates 2,4,6,inf --input-len 128 --output-len 64
    python tools/bench_serving.py --num-requests 16 --rates 4,inf --input-len 64 --output-len 16 \\
        --peer none
    python tools/bench_serving.py --peer llamacpp --num-requests 16 --rates inf \\
        --input-len 256 --output-len 128
    python tools/bench_serving.py --trace /work/shared/traces/mooncake_fast25_conversation.jsonl \\
        --window 40 --input-scale 32

Both servers load the same checkpoint (SmolLM2-135M-Instruct exported from its GGUF file unless
--model; `--model demo`: the random demo model), listen on 127.0.0.1 at a free port, and get
the same requests. With `--peer llamacpp` both serve the GGUF file itself (--model: a .gguf
file) and llama-server runs with 2 threads and --llamacpp-parallel slots (tools/llamacpp_peer.py
builds it once), its context that many slots of the longest request. The requests go through
the replay client (engine/trace/client.py): streamed completions of token-id prompts, greedy,
EOS ignored, so every output is exactly as long as asked. Poisson arrivals at each rate of
--rates (`inf`: all at once, i.e. saturation; each rate gets prompts of its own, so no rate hits
the prefix cache another one filled), or a time window of a trace (Mooncake JSONL or Azure CSV,
input lengths divided by --input-scale, arrival times kept). Each server is warmed up with two
short requests, runs every load, and is stopped (SIGTERM, a wait, then SIGKILL for it and
anything it left in its session) before the next one starts.

Printed: one table, for each load and server: requests served, req/s, output tok/s, TTFT p50 /
p99, TPOT p50 / p99 (per request: (end - first token) / (tokens - 1)), ITL p50 / p99, then a ratio
row: throughput engine / peer, latency peer / engine, so > 1 means the engine is better in
every column. Figures of one run compare; absolute figures drift across runs on a shared
machine. Exit status 1 when a server fails to start (one line names it) or a request fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import shlex
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_peer
from serving_servers import ServerFailed, engine_server, served_model, vllm_server
from vllm_peer import DEFAULT_VLLM_PYTHON, vllm_python

from engine.trace.client import ClientOptions, ReplayResult, replay
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
from engine.trace.report import percentile, replay_figures
from engine.trace.schedule import build_schedule
from engine.trace.synth import PromptSynth

SERVER_NAMES = {"engine": "engine", "vllm": "vLLM", "llamacpp": "llama.cpp"}


@dataclass(frozen=True)
class Load:
    label: str  # "4/s", "inf", "trace"
    speed: float  # divides the arrival times (inf: all at once)
    entries: list[TraceEntry]


@dataclass
class Figures:
    server: str
    load: str
    requests: int
    ok: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    first_error: str | None


def poisson_loads(args: argparse.Namespace) -> list[Load]:
    loads = []
    for i, rate in enumerate(args.rates):
        seed = args.seed + 1 + i  # prompts of its own: no rate reuses another's cached prefixes
        options = ImportOptions(synth=PromptSynth(MOONCAKE_BLOCK_TOKENS, seed=seed))
        workload = poisson_workload(
            rate=rate if math.isfinite(rate) else 1.0, num=args.num_requests,
            input_len=args.input_len, output_len=args.output_len, options=options, seed=seed,
        )  # fmt: skip
        label = f"{rate:g}/s" if math.isfinite(rate) else "inf"
        loads.append(Load(label, 1.0 if math.isfinite(rate) else math.inf, _entries(workload)))
    return loads


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
        raise SystemExit(f"bench_serving: {e}") from None
    if result.problems:
        print(f"bench_serving: {args.trace}: {len(result.problems)} malformed rows skipped "
              f"(first: {result.problems[0]})", file=sys.stderr)  # fmt: skip
    if not result.records:
        raise SystemExit(f"bench_serving: {args.trace} has no request in the window {args.window}")
    return Load("trace", args.speed, _entries(result))


def _entries(result: ImportResult) -> list[TraceEntry]:
    return [TraceEntry(i + 1, r, r.request_body()) for i, r in enumerate(result.records)]


def slot_context(loads: list[Load]) -> int:
    """Tokens of KV cache a llama-server slot needs for the longest request, in 256s."""
    longest = max(
        len(e.body["prompt"]) + e.body["max_tokens"] for load in loads for e in load.entries
    )
    return -(-longest // 256) * 256


def warmup_load() -> Load:
    options = ImportOptions(synth=PromptSynth(MOONCAKE_BLOCK_TOKENS, seed=-1))
    workload = poisson_workload(rate=1.0, num=2, input_len=16, output_len=4, options=options)
    return Load("warm-up", math.inf, _entries(workload))


# --- measuring ----------------------------------------------------------------------------------


def measure(server: str, url: str, loads: list[Load], args: argparse.Namespace) -> list[Figures]:
    model = served_model(url)
    options = ClientOptions(url, timeout=args.request_timeout)

    def run(load: Load) -> list[ReplayResult]:
        schedule = build_schedule(load.entries, speed=load.speed, model=model)
        return asyncio.run(replay(schedule, options))

    run(warmup_load())
    figures = []
    for load in loads:
        print(f"bench_serving: {SERVER_NAMES[server]}, {load.label}, "
              f"{len(load.entries)} requests", file=sys.stderr)  # fmt: skip
        figures.append(summarize(server, load.label, run(load)))
    return figures


def summarize(server: str, load: str, results: list[ReplayResult]) -> Figures:
    run = replay_figures(results)
    ok = [r for r in results if r.ok]
    tpots = [
        (r.e2e - r.ttft) / (r.completion_tokens - 1)
        for r in ok
        if r.ttft is not None and r.completion_tokens > 1
    ]
    itls = [gap for r in ok for gap in r.itls]
    failed = next((r for r in results if not r.ok), None)
    return Figures(
        server=server,
        load=load,
        requests=run.requests,
        ok=run.ok,
        requests_per_s=run.requests_per_s,
        output_tokens_per_s=run.output_tokens_per_s,
        ttft_p50_ms=_ms(run.ttft.p50),
        ttft_p99_ms=_ms(run.ttft.p99),
        tpot_p50_ms=_ms(percentile(tpots, 50)),
        tpot_p99_ms=_ms(percentile(tpots, 99)),
        itl_p50_ms=_ms(percentile(itls, 50)),
        itl_p99_ms=_ms(percentile(itls, 99)),
        first_error=failed.error if failed else None,
    )


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


# --- reporting ----------------------------------------------------------------------------------

# (header, Figures field, format, True when higher is better)
COLUMNS = (
    ("req/s", "requests_per_s", "{:.2f}", True),
    ("out tok/s", "output_tokens_per_s", "{:.1f}", True),
    ("TTFT p50", "ttft_p50_ms", "{:.1f}", False),
    ("TTFT p99", "ttft_p99_ms", "{:.1f}", False),
    ("TPOT p50", "tpot_p50_ms", "{:.1f}", False),
    ("TPOT p99", "tpot_p99_ms", "{:.1f}", False),
    ("ITL p50", "itl_p50_ms", "{:.1f}", False),
    ("ITL p99", "itl_p99_ms", "{:.1f}", False),
)


def ratios(ours: Figures, peer: Figures) -> dict[str, float | None]:
    """Engine / peer for throughput, peer / engine for latency: > 1 = the engine is better."""
    out: dict[str, float | None] = {}
    for _, name, _, higher_better in COLUMNS:
        a, b = getattr(ours, name), getattr(peer, name)
        top, bottom = (a, b) if higher_better else (b, a)
        out[name] = top / bottom if top is not None and bottom else None
    return out


def render(describe: str, figures: list[Figures]) -> str:
    names = list(dict.fromkeys(_name(f) for f in figures))
    widths = [max(8, *(len(n) + 2 for n in names)), 8, 7] + [10] * len(COLUMNS)
    head = ["server", "load", "ok", *(h for h, *_ in COLUMNS)]
    units = "latencies in ms"
    if len(names) > 1:
        first, second = names[:2]
        units += (f"; ratio rows: throughput {first}/{second}, latency {second}/{first} "
                  f"(> 1 = {first} better)")  # fmt: skip
    lines = [describe, units, "", _line(head, widths)]
    for load in dict.fromkeys(f.load for f in figures):
        rows = [f for f in figures if f.load == load]
        for f in rows:
            cells = [_cell(getattr(f, name), fmt) for _, name, fmt, _ in COLUMNS]
            lines.append(_line([_name(f), load, f"{f.ok}/{f.requests}", *cells], widths))
        if len(rows) == 2:
            cells = [_cell(r, "{:.2f}x") for r in ratios(rows[0], rows[1]).values()]
            lines.append(_line(["ratio", load, "", *cells], widths))
    for f in figures:
        if f.first_error:
            lines.append(f"{_name(f)} at {f.load}: {f.requests - f.ok} failed, "
                         f"first: {f.first_error}")  # fmt: skip
    return "\n".join(lines)


def _name(figures: Figures) -> str:
    """How a row is labelled: vLLM's or ours; a setup of ours by its own name (bench_pd)."""
    return SERVER_NAMES.get(figures.server, figures.server)


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def _line(cells: list[str], widths: list[int]) -> str:
    return "".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(
        zip(cells, widths, strict=True)))  # fmt: skip


def main() -> int:
    args = parse_args()
    from engine.home import default_engine_home
    from engine.model_source import hf_checkpoint

    loads = [trace_load(args)] if args.trace else poisson_loads(args)
    if args.peer == "llamacpp":  # both read the GGUF file; the float32 export is vLLM's
        gguf = llamacpp_peer.model_file(args.model)
        llamacpp_peer.binaries()  # built before the engine's run, not after
        model = str(gguf)
    else:
        model = hf_checkpoint(args.model, default_engine_home())
    logs = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    servers: dict[str, Callable[[], contextlib.AbstractContextManager[str]]] = {
        "engine": lambda: engine_server(
            model, logs, shlex.split(args.engine_args), args.start_timeout
        ),
    }
    if args.peer == "vllm":
        python = vllm_python(args.vllm_python)  # found before the engine's run, not after
        servers["vllm"] = lambda: vllm_server(
            python, model, logs, shlex.split(args.vllm_args), args.start_timeout
        )
    elif args.peer == "llamacpp":
        slots = args.llamacpp_parallel
        context = slots * slot_context([warmup_load(), *loads])
        servers["llamacpp"] = lambda: llamacpp_peer.llama_server(
            gguf, slots, context, logs, args.start_timeout
        )
    if args.trace:
        describe = (f"{args.trace}, window {args.window[0]:g}-{args.window[1]:g} s, inputs ÷ "
                    f"{args.input_scale:g}, speed {args.speed:g}x; {model}")  # fmt: skip
    else:
        describe = (f"Poisson, {args.num_requests} requests per rate, {args.input_len} in / "
                    f"{args.output_len} out, greedy, EOS ignored; {model}")  # fmt: skip
    figures: list[Figures] = []
    for name, start in servers.items():  # one after the other: never both running
        try:
            with start() as url:
                figures += measure(name, url, loads, args)
        except ServerFailed as e:
            print(f"bench_serving: {e}", file=sys.stderr)  # its log is kept
            return 1
    shutil.rmtree(logs)
    if args.json:
        pairs = zip(figures[: len(loads)], figures[len(loads) :], strict=False)  # engine, peer
        print(json.dumps({
            "workload": describe,
            "figures": [asdict(f) for f in figures],
            "ratios": {ours.load: ratios(ours, peer) for ours, peer in pairs},
        }))  # fmt: skip
    else:
        print(render(describe, figures))
    return 0 if all(f.ok == f.requests for f in figures) else 1


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        help="checkpoint directory, .gguf file or 'demo' (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--peer", choices=["vllm", "llamacpp", "none"], default="vllm")
    p.add_argument(
        "--rates",
        type=_rates,
        default=[2.0, 4.0, 6.0, math.inf],
        help="Poisson request rates per second, comma-separated; inf = all at once",
    )
    p.add_argument("--num-requests", type=int, default=64, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
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
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--llamacpp-parallel", type=int, default=16, help="llama-server's slots (-np)")
    p.add_argument(
        "--engine-args",
        default="",
        help="more flags for `python -m engine`, e.g. --engine-args='--max-num-seqs 64'",
    )
    p.add_argument(
        "--vllm-args",
        default="",
        help="more flags for vLLM's api_server, e.g. --vllm-args='--max-num-seqs 64'",
    )
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds per server start")
    p.add_argument("--request-timeout", type=float, default=1800.0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = p.parse_args()
    for name in ("num_requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.input_scale > 0 or not args.speed > 0:
        p.error("--input-scale and --speed must be > 0")
    return args  # fmt: skip


def _rates(text: str) -> list[float]:
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
        raise argparse.ArgumentTypeError(f"expected SECONDS or START:END (0 <= START < END), "
                                         f"got {text!r}")  # fmt: skip
    return window


if __name__ == "__main__":
    sys.exit(main())
