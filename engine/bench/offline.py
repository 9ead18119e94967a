"""`engine bench offline`: a batch of requests through the library (`LLM`), end to end, as
vLLM's `vllm bench throughput`.

    engine bench offline --model demo --num-requests 16 --input-len 32 --output-len 64
    engine bench offline --tp 2 --dp 2          # against TP=1 / DP=1, in the same run
    engine bench offline --deterministic        # batch-invariant kernels against the default ones

Prompts are random token ids (seeded); every request decodes exactly its output length (greedy,
EOS ignored). Printed: output tokens/s and seconds; with --tp or --dp above 1 (or
--deterministic) the engine first runs the workload at TP=1 / DP=1 (default kernels) and the ratio
and the agreement of the greedy outputs are printed against it. `--repeats N` times the workload
N times, each with fresh prompts (a prefix-cache hit would skip the prefill), and reports the
median. tools/bench/offline.py runs the same code beside transformers, vLLM or llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

# The prompts (token ids) and each one's output length.
Workload = tuple[list[list[int]], list[int]]


@dataclass
class Run:
    name: str
    seconds: list[float]  # one per repeat
    output_tokens: list[int]  # one per repeat
    outputs: list[list[int]]  # every repeat's, in order

    @property
    def tokens_per_s(self) -> float:
        rates = zip(self.output_tokens, self.seconds, strict=True)
        return statistics.median(tokens / seconds for tokens, seconds in rates)

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


def make_workloads(args: argparse.Namespace, vocab_size: int) -> list[Workload]:
    return [make_workload(args, vocab_size, args.seed + r) for r in range(args.repeats)]


def make_workload(args: argparse.Namespace, vocab_size: int, seed: int) -> Workload:
    rng = random.Random(seed)

    def length(mean: int) -> int:
        spread = int(mean * args.range_ratio)
        return max(1, rng.randint(mean - spread, mean + spread))

    prompts = [
        [rng.randrange(10, vocab_size) for _ in range(length(args.input_len))]
        for _ in range(args.num_requests)
    ]
    return prompts, [length(args.output_len) for _ in prompts]


def run_engine(
    args: argparse.Namespace,
    path: str,
    workloads: list[Workload],
    tp: int = 1,
    dp: int = 1,
    name: str = "engine",
    deterministic: bool = False,
) -> Run:
    from engine import LLM, SamplingParams

    options = {
        "tensor_parallel_size": tp,
        "data_parallel_size": dp,
        "kv_cache_memory": args.kv_cache_memory,
        "scheduler__max_num_seqs": max(len(workloads[0][0]), 1),
        "model__deterministic": deterministic,
        "device": args.device,
        "dtype": args.dtype,
        "model__kernel_backend": args.kernel_backend,
    }
    run = Run(name, [], [], [])
    with LLM(path, **options) as llm:
        warm = workloads[0][0][:2]
        llm.generate(warm, SamplingParams(max_tokens=4, temperature=0.0))  # warm-up
        for prompts, outs in workloads:
            params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outs]
            start = time.perf_counter()
            results = llm.generate(prompts, params)
            run.seconds.append(time.perf_counter() - start)
            tokens = [r.outputs[0].token_ids for r in results]
            run.output_tokens.append(sum(map(len, tokens)))
            run.outputs += tokens
    return run


BASELINE = "engine_tp1_dp1"


def report(args: argparse.Namespace, runs: list[Run], baseline: Run | None) -> None:
    ours = runs[0]
    summary: dict[str, object] = {
        "num_requests": args.num_requests,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "tp": args.tp,
        "dp": args.dp,
        "deterministic": args.deterministic,
        "repeats": args.repeats,
    }
    for run in ([baseline] if baseline else []) + runs:
        summary[f"{run.name}_tok_per_s"] = round(run.tokens_per_s, 1)
        summary[f"{run.name}_seconds"] = round(run.median_seconds, 3)
    if baseline is not None:
        summary["parallel_ratio"] = round(ours.tokens_per_s / baseline.tokens_per_s, 3)
        summary["same_greedy_as_tp1_dp1"] = _same(ours, baseline)
    if len(runs) > 1:
        peer = runs[1]
        summary["ratio"] = round(ours.tokens_per_s / peer.tokens_per_s, 3)
        summary["same_greedy_outputs"] = _same(ours, peer)
    if args.json:
        print(json.dumps(summary))
        return
    mode = ", deterministic mode" if args.deterministic else ""
    repeats = f"; median of {args.repeats} runs" if args.repeats > 1 else ""
    print(
        f"{args.num_requests} requests, {args.input_len} in / {args.output_len} out, greedy; "
        f"engine at TP={args.tp} x DP={args.dp}{mode}{repeats}"
    )
    for run in ([baseline] if baseline else []) + runs:
        rates = ""
        if len(run.seconds) > 1:
            each = [f"{t / s:.0f}" for t, s in zip(run.output_tokens, run.seconds, strict=True)]
            rates = f"  runs: {', '.join(each)}"
        print(
            f"  {run.name:15s} {run.tokens_per_s:9.1f} output tok/s  "
            f"({run.median_seconds:.2f} s){rates}"
        )
    if baseline is not None:
        print(
            f"  ratio TP={args.tp} x DP={args.dp}{mode} / TP=1 x DP=1: "
            f"{summary['parallel_ratio']:.2f}x; identical greedy outputs: "
            f"{summary['same_greedy_as_tp1_dp1']}"
        )
    if len(runs) > 1:
        print(
            f"  ratio engine / {runs[1].name}: {summary['ratio']:.2f}x; "
            f"identical greedy outputs: {summary['same_greedy_outputs']}"
        )


def _same(a: Run, b: Run) -> str:
    """Whole outputs equal; and, since half precision drifts apart after a near tie, how far
    each pair agrees: the first token, and the median length of the agreeing prefix."""
    pairs = list(zip(a.outputs, b.outputs, strict=True))
    same = sum(x == y for x, y in pairs)
    first = sum(x[:1] == y[:1] for x, y in pairs)
    prefix = statistics.median(_agreeing_prefix(x, y) for x, y in pairs)
    return (
        f"{same}/{len(pairs)} (first token {first}/{len(pairs)}, "
        f"median agreeing prefix {prefix:.0f} tokens)"
    )


def _agreeing_prefix(x: list[int], y: list[int]) -> int:
    return next(
        (i for i, (s, t) in enumerate(zip(x, y, strict=False)) if s != t), min(len(x), len(y))
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The workload and the engine's launch: what the tool with peers shares."""
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--range-ratio", type=float, default=0.0, help="lengths vary ± this share")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=int, default=1, help="time the workload this many times (fresh prompts)"
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica")
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    p.add_argument("--kv-cache-memory", type=int, default=512 * 2**20)
    p.add_argument("--device", default="auto", help="auto (cuda if present), cpu, cuda")
    p.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    p.add_argument("--kernel-backend", default="auto", help="auto, torch, triton, cpu")
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="the engine in deterministic mode, against the default mode in the same run",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("num_requests", "input_len", "output_len", "repeats", "tp", "dp"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


Peer = Callable[[argparse.Namespace, str, list[Workload]], Run]


def run_offline(args: argparse.Namespace, path: str, peer: Peer | None = None) -> None:
    """The engine on `path` (a checkpoint directory), after its TP=1 / DP=1 baseline where asked,
    then `peer` on the same workloads; the report printed."""
    from engine.model.config import load_model_config

    workloads = make_workloads(args, load_model_config(path).vocab_size)
    baseline = None
    if args.tp > 1 or args.dp > 1 or args.deterministic:  # the reference first, same run
        baseline = run_engine(args, path, workloads, name=BASELINE)
    name = "engine_determ" if args.deterministic else "engine"
    runs = [
        run_engine(args, path, workloads, args.tp, args.dp, name, deterministic=args.deterministic)
    ]
    if peer is not None:
        runs.append(peer(args, path, workloads))
    report(args, runs, baseline)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="engine bench offline", description=__doc__.split("\n")[0] if __doc__ else None
    )
    p.add_argument(
        "--model",
        help="a checkpoint directory, a .gguf file or 'demo' (default: the default model)",
    )
    add_arguments(p)
    args = p.parse_args(argv)
    check_arguments(p, args)
    from engine.launch.model_source import model_directory
    from engine.settings.home import default_engine_home

    path, _ = model_directory(args.model, default_engine_home())
    run_offline(args, path)
    return 0
