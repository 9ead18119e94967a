"""Online serving: our server and its peers (llama.cpp, vLLM), one after the other, one workload.

    python tools/bench/serving.py          # llama.cpp, vLLM: 1, 4, 16, 64 streams and 1 req/s
    python tools/bench/serving.py --peer llamacpp,vllm --precision q4_1 --streams 1,16 --rates none
    python tools/bench/serving.py --model demo --peer none --streams 1,4 --rates 4,inf \\
        --num-requests 16 --input-len 64 --output-len 16
    python tools/bench/serving.py --trace /work/shared/traces/mooncake_fast25_conversation.jsonl \\
        --window 40 --input-scale 32

Every server serves the same model (SmolLM2-135M-Instruct from its GGUF file unless --model;
`--model demo`: the random demo model) on 127.0.0.1 at a free port and gets the same requests.
--precision float32 (default): the engine and vLLM serve the model's float32 HF export,
llama-server an F32 copy of its GGUF file (tools/peers/llamacpp_peer.py makes it once); q4_1: the
engine and llama-server serve the GGUF file itself (the default model's is Q4_1) and vLLM, which
cannot serve it on the CPU, the float32 export (its rows say so). llama-server runs with 2
threads and --llamacpp-parallel slots, its context that many slots of the longest request.
Requests go through the replay client (engine/trace/client.py): streamed completions of token-id
prompts, greedy, EOS ignored, so every output is exactly as long as asked. Loads: for each N of
--streams, a closed loop of N streams each sending --requests-per-stream requests back to back;
for each rate of --rates, Poisson arrivals (`inf`: all at once); each load has prompts of its own,
so none hits the prefix cache another one filled. Or, with --trace, a time window of a trace
(Mooncake JSONL or Azure CSV, inputs divided by --input-scale, arrival times kept). The engine
runs first, then each peer of --peer; each server is warmed up with two short requests, runs
every load, and is stopped (SIGTERM, a wait, then SIGKILL for it and anything it left in its
session) before the next one starts.

Printed: one table, for each load and server: requests served, req/s, output tok/s, TTFT p50 /
p99, TPOT p50 / p99 (per request: (end - first token) / (tokens - 1)), ITL p50 / p99, then one
ratio row per peer: throughput engine / peer, latency peer / engine, so > 1 means the engine is
better in every column. Under it, per load, the engine's own figures from its GET /metrics just
before and after (after a scheduler report's wait): steps, compute ms per step and its share of the
load's time, gaps between two steps of a running batch, their mean and the scheduler's part,
output tokens per compute second (the raw model's decode rate while serving), and each actor's
CPU in % of one core; "—" where the engine exports no such metric. --json: the same as one
object. Figures of one run compare; absolute figures drift across runs on a shared machine.
Exit status 1 when a server fails to start (one line names it) or a request fails.
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
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.client.servers import ServerFailed, engine_server, served_model
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
from tools.peers import llamacpp_peer
from tools.peers.vllm_peer import DEFAULT_VLLM_PYTHON, vllm_python, vllm_server

SERVER_NAMES = {"engine": "engine", "vllm": "vLLM", "llamacpp": "llama.cpp"}
PEERS = ("llamacpp", "vllm")
PRECISIONS = ("float32", "q4_1")
# The engine's scheduler reports its figures every 0.2 s while busy (actor CPU is read at the
# scrape): wait this long after a load before reading /metrics, so the figures cover all of it.
# load before reading /metrics, so the figures cover the whole load.
METRICS_SETTLE_S = 0.5


@dataclass(frozen=True)
class Load:
    label: str  # "16 streams", "4/s", "inf", "trace"
    speed: float  # divides the arrival times (inf: all at once)
    entries: list[TraceEntry]
    streams: int | None = None  # a closed loop: at most this many requests in flight


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


@dataclass
class EngineSteps:
    """The engine's own figures over one load: deltas of its /metrics counters (None: the engine
    does not export that metric)."""

    load: str
    wall_s: float
    steps: float | None
    compute_ms_per_step: float | None
    compute_share: float | None  # compute seconds / the load's wall time
    gaps: float | None
    gap_ms: float | None  # mean time between two steps of a running batch
    gap_scheduler_ms: float | None  # the scheduler's part of it
    tokens_per_compute_s: float | None  # output tokens / compute seconds
    actor_cpu_percent: dict[str, float] = field(default_factory=dict)  # of one core


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
    return poisson_workload(rate=rate, num=num, input_len=args.input_len,
                            output_len=args.output_len, options=options, seed=seed)  # fmt: skip


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
        print(f"bench_serving: {server}, {load.label}, "
              f"{len(load.entries)} requests", file=sys.stderr)  # fmt: skip
        start = time.monotonic()
        results = run(load)
        wall = time.monotonic() - start
        figures.append(summarize(server, load.label, results))
        if engine:
            before, counters = counters, settled_scrape(url)
            tokens = sum(r.completion_tokens for r in results if r.ok)
            steps.append(engine_steps(load.label, before, counters, wall, tokens))
    return figures, steps


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


# --- the engine's /metrics ----------------------------------------------------------------------

STEPS = "engine:steps_total"
STEP_COMPUTE = "engine:step_compute_seconds_total"
STEP_GAPS = "engine:step_gaps_total"
STEP_GAP_SECONDS = "engine:step_gap_seconds_total"
STEP_GAP_SCHEDULER = "engine:step_gap_scheduler_seconds_total"
ACTOR_CPU = "engine:actor_cpu_seconds_total"
ACTOR_ORDER = ("root", "tokenizer", "scheduler", "worker", "detokenizer")

Counters = dict[tuple[str, str], float]  # (sample name, its actor label or "") -> value


def parse_metrics(text: str) -> Counters:
    """The samples of a Prometheus text exposition, summed over every label but `actor`; {} for
    text that does not parse."""
    from prometheus_client.parser import text_string_to_metric_families

    counters: Counters = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.name, sample.labels.get("actor", ""))
                counters[key] = counters.get(key, 0.0) + sample.value
    except ValueError:
        return {}
    return counters


def settled_scrape(url: str) -> Counters:
    """The server's /metrics once its scheduler's report caught up; {} when it has none."""
    time.sleep(METRICS_SETTLE_S)
    with contextlib.suppress(httpx.HTTPError):
        reply = httpx.get(url + "/metrics", timeout=30.0)
        if reply.status_code == 200:
            return parse_metrics(reply.text)
    return {}


def engine_steps(
    load: str, before: Counters, after: Counters, wall_s: float, output_tokens: int
) -> EngineSteps:
    """The engine's step figures over a load from its counters before and after it."""

    def delta(name: str, actor: str = "") -> float | None:
        if (name, actor) not in after:
            return None
        return after[name, actor] - before.get((name, actor), 0.0)  # absent before: it was 0

    steps, compute = delta(STEPS), delta(STEP_COMPUTE)
    gaps, gap_s, scheduler_s = delta(STEP_GAPS), delta(STEP_GAP_SECONDS), delta(STEP_GAP_SCHEDULER)
    actors = sorted(
        (actor for name, actor in after if name == ACTOR_CPU),
        key=lambda a: (_actor_rank(a.rstrip("0123456789")), a),  # worker0 with the workers
    )
    return EngineSteps(
        load=load,
        wall_s=wall_s,
        steps=steps,
        compute_ms_per_step=_per(compute, steps, 1000.0),
        compute_share=_per(compute, wall_s),
        gaps=gaps,
        gap_ms=_per(gap_s, gaps, 1000.0),
        gap_scheduler_ms=_per(scheduler_s, gaps, 1000.0),
        tokens_per_compute_s=_per(float(output_tokens), compute),
        actor_cpu_percent={
            a: 100.0 * seconds / wall_s
            for a in actors
            if (seconds := delta(ACTOR_CPU, a)) is not None and wall_s > 0
        },
    )


def _actor_rank(kind: str) -> int:
    return ACTOR_ORDER.index(kind) if kind in ACTOR_ORDER else len(ACTOR_ORDER)


def _per(top: float | None, bottom: float | None, scale: float = 1.0) -> float | None:
    return None if top is None or not bottom else top / bottom * scale


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


def ratio_pairs(figures: list[Figures]) -> list[tuple[Figures, Figures]]:
    """(first server's figures, another server's) for each load and each other server: the first
    server (the engine) is what every ratio row measures the others against."""
    first = _name(figures[0]) if figures else ""
    ours = {f.load: f for f in figures if _name(f) == first}
    return [(ours[f.load], f) for f in figures if _name(f) != first and f.load in ours]


def render(describe: str, figures: list[Figures], steps: list[EngineSteps] | None = None) -> str:
    names = list(dict.fromkeys(_name(f) for f in figures))
    pairs = ratio_pairs(figures)
    labels = [*names, *(f"ratio vs {n}" for n in names[1:])]
    widths = [max(8, *(len(n) + 2 for n in labels)), 12, 8] + [10] * len(COLUMNS)
    head = ["server", "load", "ok", *(h for h, *_ in COLUMNS)]
    units = "latencies in ms"
    if len(names) > 1:
        units += (f"; 'ratio vs PEER' rows: throughput {names[0]} / PEER, latency PEER / "
                  f"{names[0]} (> 1 = {names[0]} better)")  # fmt: skip
    lines = [describe, units, "", _line(head, widths)]
    for load in dict.fromkeys(f.load for f in figures):
        for f in figures:
            if f.load == load:
                cells = [_cell(getattr(f, name), fmt) for _, name, fmt, _ in COLUMNS]
                lines.append(_line([_name(f), load, f"{f.ok}/{f.requests}", *cells], widths))
        for ours, peer in pairs:
            if ours.load == load:
                cells = [_cell(r, "{:.2f}x") for r in ratios(ours, peer).values()]
                lines.append(_line([f"ratio vs {_name(peer)}", load, "", *cells], widths))
    for f in figures:
        if f.first_error:
            lines.append(f"{_name(f)} at {f.load}: {f.requests - f.ok} failed, "
                         f"first: {f.first_error}")  # fmt: skip
    if steps:
        lines += ["", render_steps(steps)]
    return "\n".join(lines)


# (header, EngineSteps field, format)
STEP_COLUMNS = (
    ("steps", "steps", "{:.0f}"),
    ("ms/step", "compute_ms_per_step", "{:.1f}"),
    ("busy", "compute_share", "{:.0%}"),
    ("gaps", "gaps", "{:.0f}"),
    ("gap ms", "gap_ms", "{:.2f}"),
    ("sched ms", "gap_scheduler_ms", "{:.2f}"),
    ("tok/s", "tokens_per_compute_s", "{:.1f}"),
)


def render_steps(steps: list[EngineSteps]) -> str:
    """One line per load of the engine's own figures."""
    widths = [12] + [10] * len(STEP_COLUMNS)
    lines = [
        "engine, from GET /metrics before and after each load: steps, compute ms per step, busy ="
        " compute / the load's time,",
        "gaps between two steps of a running batch (mean ms, the scheduler's part), tok/s = output"
        " tokens / compute seconds, actor CPU in % of one core",
        "",
        _line(["load", *(h for h, *_ in STEP_COLUMNS)], widths, 1) + "  actor CPU %",
    ]
    for s in steps:
        cells = [_cell(getattr(s, name), fmt) for _, name, fmt in STEP_COLUMNS]
        cpu = ", ".join(f"{a} {p:.0f}" for a, p in s.actor_cpu_percent.items()) or "—"
        lines.append(_line([s.load, *cells], widths, 1) + f"  {cpu}")
    return "\n".join(lines)


def _name(figures: Figures) -> str:
    """How a row is labelled: vLLM's or ours; a setup of ours by its own name (bench_pd)."""
    return SERVER_NAMES.get(figures.server, figures.server)


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def _line(cells: list[str], widths: list[int], left: int = 3) -> str:
    """The first `left` cells left-aligned, the others right-aligned."""
    return "".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(
        zip(cells, widths, strict=True)))  # fmt: skip


# --- the run ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Files:
    """What each server serves at the chosen precision."""

    engine: str
    llamacpp: Path | None  # a GGUF file
    vllm: str | None  # an HF checkpoint directory

    def describe(self, precision: str) -> str:
        if precision == "float32":
            parts = [f"{'engine and vLLM serve' if self.vllm else 'engine serves'} {self.engine}"]
            if self.llamacpp:
                parts.append(f"llama.cpp {self.llamacpp}")
        else:
            serve = "engine and llama.cpp serve" if self.llamacpp else "engine serves"
            parts = [f"{serve} {self.engine}"]
            if self.vllm:
                parts.append(f"vLLM the float32 export {self.vllm} (no GGUF on its CPU backend)")
        return f"{precision}: " + "; ".join(parts)


def files_for(model: str | None, precision: str, peers: list[str]) -> Files:
    from engine.home import default_engine_home
    from engine.model_source import hf_checkpoint

    home = default_engine_home()
    export = hf_checkpoint(model, home) if precision == "float32" or "vllm" in peers else None
    gguf = None
    if precision == "q4_1" or "llamacpp" in peers:
        gguf = _gguf_file(model, precision)
    if precision == "float32":
        assert export is not None
        llamacpp = llamacpp_peer.f32_file(gguf) if gguf and "llamacpp" in peers else None
        return Files(export, llamacpp, export if "vllm" in peers else None)
    assert gguf is not None
    return Files(str(gguf), gguf if "llamacpp" in peers else None, export)


def _gguf_file(model: str | None, precision: str) -> Path:
    try:
        return llamacpp_peer.model_file(model)
    except SystemExit:
        why = "llama.cpp's F32 copy is made from" if precision == "float32" else "q4_1 serves"
        raise SystemExit(f"bench_serving: --model must be a .gguf file ({why} it), "
                         f"got {model!r}") from None  # fmt: skip


def main() -> int:
    args = parse_args()
    loads = [trace_load(args)] if args.trace else loads_of(args)
    if "llamacpp" in args.peer:
        llamacpp_peer.binaries()  # built before the engine's run, not after
    files = files_for(args.model, args.precision, args.peer)
    logs = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    servers: dict[str, Callable[[], contextlib.AbstractContextManager[str]]] = {
        "engine": partial(
            engine_server, files.engine, logs, shlex.split(args.engine_args), args.start_timeout
        ),
    }
    for peer in args.peer:
        if peer == "llamacpp":
            assert files.llamacpp is not None
            slots = args.llamacpp_parallel
            context = slots * slot_context([warmup_load(), *loads])
            servers["llama.cpp"] = partial(
                llamacpp_peer.llama_server, files.llamacpp, slots, context, logs,
                args.start_timeout,
            )  # fmt: skip
        elif peer == "vllm":
            assert files.vllm is not None
            python = vllm_python(args.vllm_python)  # found before the engine's run, not after
            label = "vLLM" if args.precision == "float32" else "vLLM (float32)"
            servers[label] = partial(
                vllm_server, python, files.vllm, logs, shlex.split(args.vllm_args),
                args.start_timeout,
            )  # fmt: skip
    describe = f"{describe_loads(args, loads)}; {files.describe(args.precision)}"
    if "llamacpp" in args.peer:
        describe += f" (llama-server -t {llamacpp_peer.THREADS} -np {args.llamacpp_parallel})"
    figures: list[Figures] = []
    steps: list[EngineSteps] = []
    for name, start in servers.items():  # one after the other: never two running
        try:
            with start() as url:
                server_figures, server_steps = measure(name, url, loads, args, name == "engine")
        except ServerFailed as e:
            print(f"bench_serving: {e}", file=sys.stderr)  # its log is kept
            return 1
        figures += server_figures
        steps += server_steps
    shutil.rmtree(logs)
    if args.json:
        by_peer: dict[str, dict[str, dict[str, float | None]]] = {}
        for ours, peer in ratio_pairs(figures):
            by_peer.setdefault(peer.server, {})[ours.load] = ratios(ours, peer)
        print(json.dumps({
            "workload": describe,
            "figures": [asdict(f) for f in figures],
            "ratios": by_peer,
            "engine_steps": [asdict(s) for s in steps],
        }))  # fmt: skip
    else:
        print(render(describe, figures, steps))
    return 0 if all(f.ok == f.requests for f in figures) else 1


def describe_loads(args: argparse.Namespace, loads: list[Load]) -> str:
    if args.trace:
        return (f"{args.trace}, window {args.window[0]:g}-{args.window[1]:g} s, inputs ÷ "
                f"{args.input_scale:g}, speed {args.speed:g}x")  # fmt: skip
    parts = []
    if args.streams:
        counts = ", ".join(str(n) for n in args.streams)
        each = f"{args.streams_requests} request{'s' if args.streams_requests > 1 else ''} each"
        parts.append(f"closed loop at {counts} streams, {each}")
    if args.rates:
        parts.append(f"Poisson, {args.num_requests} requests per rate")
    return (f"{'; '.join(parts)}; {args.input_len} in / {args.output_len} out, greedy, "
            "EOS ignored")  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model",
        help="checkpoint directory, .gguf file or 'demo' (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--peer",
        type=_peers,
        default=["llamacpp", "vllm"],
        help="peers after the engine, comma-separated: llamacpp, vllm; none: the engine alone "
        "(default llamacpp,vllm)",
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="float32",
        help="float32: the float32 export (llama.cpp: an F32 GGUF copy); q4_1: the GGUF file "
        "itself for the engine and llama.cpp, vLLM still float32 (default float32)",
    )
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
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument(
        "--llamacpp-parallel",
        type=int,
        default=None,
        help="llama-server's slots (-np; default the most --streams, at least 16)",
    )
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
    if args.llamacpp_parallel is None:  # a slot per stream: none waits in llama-server's queue
        args.llamacpp_parallel = max([16, *args.streams])
    positive = ("num_requests", "input_len", "output_len", "streams_requests", "llamacpp_parallel")
    for name in positive:
        if getattr(args, name) < 1:
            flag = {"streams_requests": "requests-per-stream"}.get(name, name.replace("_", "-"))
            p.error(f"--{flag} must be >= 1, got {getattr(args, name)}")
    if not args.input_scale > 0 or not args.speed > 0:
        p.error("--input-scale and --speed must be > 0")
    if not args.trace and not args.streams and not args.rates:
        p.error("nothing to run: --streams and --rates are both none")
    return args  # fmt: skip


def _peers(text: str) -> list[str]:
    """'llamacpp,vllm' -> ["llamacpp", "vllm"] (in that order, once each); 'none' -> []."""
    parts = [part.strip() for part in text.split(",")]
    if parts == ["none"]:
        return []
    if not parts or not all(part in PEERS for part in parts):
        raise argparse.ArgumentTypeError(f"expected peers from {', '.join(PEERS)} "
                                         f"(comma-separated) or none, got {text!r}")  # fmt: skip
    return list(dict.fromkeys(parts))


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
        raise argparse.ArgumentTypeError(f"expected SECONDS or START:END (0 <= START < END), "
                                         f"got {text!r}")  # fmt: skip
    return window


if __name__ == "__main__":
    sys.exit(main())
