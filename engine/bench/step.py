"""`engine bench step`: static batches through the raw model (no scheduler, no processes), as
SGLang's bench_one_batch: the cost of one forward step, prefill and decode.

    engine bench step --model demo --batch-size 1 8 --input-len 128 --output-len 32
    engine bench step --correct            # greedy text for a few real prompts
    engine bench step --profile            # a torch profiler trace of decode steps

For each (batch size, input length, output length): prefill the whole batch in one step, then
decode output_len - 1 steps; report prefill latency and throughput, median decode step latency
and decode throughput, each next to this machine's limit for that step (engine/bench/
step_limits.py: bytes read over the measured memory bandwidth, FLOPs over the measured matmul
rate). A warm-up case runs first and is not reported; cases whose KV cache would not fit are
skipped with a note. tools/bench/one_batch.py runs the same code and adds tensor and data
parallel ranks, HF generate and llama.cpp's llama-bench beside it.

torch should be imported after engine.model.placement.policy.sleeping_openmp_threads() has run
(as the engine's workers do), so the caller calls it before importing this module.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.bench.raw_model import (
    CaseResult,
    bench_case,
    decode_steps,
    fits,
    prefill_batch,
    random_prompts,
    static_block_tables,
)
from engine.bench.step_limits import MachineRates, ModelCost
from engine.model.quantized.formats import describe_formats
from engine.model.runner import ModelRunner, describe_threads
from engine.model.step_inputs import SeqChunk

CORRECTNESS_PROMPTS = [
    "The harbour at first light",
    "To make a simple loaf, start with",
    "A ring buffer is the classic shape for",
    "Dear Ana,",
]


def greedy_texts(runner: ModelRunner, prompts: Sequence[str], output_len: int) -> list[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(runner.model_path)
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    longest = max(len(p) for p in prompt_ids) + output_len
    tables = static_block_tables(runner, len(prompts), longest)
    chunks = [
        SeqChunk(i, p, 0, t, True) for i, (p, t) in enumerate(zip(prompt_ids, tables, strict=True))
    ]
    generated = [[t] for t in runner.forward(chunks).argmax(-1).tolist()]
    for _ in range(output_len - 1):
        chunks = [
            SeqChunk(i, [seq[-1]], len(prompt_ids[i]) + len(seq) - 1, tables[i], True)
            for i, seq in enumerate(generated)
        ]
        for seq, token in zip(generated, runner.forward(chunks).argmax(-1).tolist(), strict=True):
            seq.append(token)
    return [str(tokenizer.decode(seq)) for seq in generated]


def profile_decode(
    runner: ModelRunner, batch_size: int, input_len: int, steps: int, out: Path
) -> None:
    from torch.profiler import ProfilerActivity, profile

    tables = static_block_tables(runner, batch_size, input_len + steps + 2)
    tokens, _ = prefill_batch(runner, random_prompts(runner, batch_size, input_len), tables)
    tokens = [seq[-1] for seq in decode_steps(runner, tokens, input_len, tables, 2)[0]]
    activities = [ProfilerActivity.CPU]
    if runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as profiler:
        decode_steps(runner, tokens, input_len + 2, tables, steps)
    profiler.export_chrome_trace(str(out))
    print(f"wrote a trace of {steps} decode steps (batch {batch_size}) to {out}")


def print_table(results: list[CaseResult], runner: ModelRunner, rates: MachineRates) -> None:
    """Each figure with `limit`: the roofline time of that step on this machine (step_limits),
    and the share of it reached (limit / measured; 100% = at the roofline)."""
    cost = ModelCost.of(runner)
    header = (
        f"{'batch':>5} {'in':>5} {'out':>5} | {'prefill ms':>10} {'tok/s':>7} {'limit ms':>8} "
        f"{'share':>5} | {'decode ms/step':>14} {'tok/s':>6} {'limit ms':>8} {'share':>5} | "
        f"{'total s':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        prefill_limit = cost.prefill(r.batch_size, r.input_len).limit_seconds(rates)
        context = r.input_len + r.output_len // 2  # keys seen at the median decode step
        decode_limit = cost.decode(r.batch_size, context).limit_seconds(rates)
        print(
            f"{r.batch_size:>5} {r.input_len:>5} {r.output_len:>5} | "
            f"{r.prefill_seconds * 1e3:>10.2f} {r.prefill_tokens_per_second:>7.0f} "
            f"{prefill_limit * 1e3:>8.2f} {prefill_limit / r.prefill_seconds:>5.0%} | "
            f"{r.decode_step_seconds * 1e3:>14.3f} {r.decode_tokens_per_second:>6.0f} "
            f"{decode_limit * 1e3:>8.2f} {decode_limit / r.decode_step_seconds:>5.0%} | "
            f"{r.total_seconds:>7.3f}"
        )
    print_experts_read(results, cost)


def print_experts_read(results: list[CaseResult], cost: ModelCost) -> None:
    """A mixture of experts: the experts a decode step ran, measured, beside what uniform
    routing predicts and all E, and the weight bytes a step and a token read for it."""
    total, picked = cost.experts
    if not total:
        return
    per_expert = cost.expert_bytes / total  # of every MoE layer together
    dense, experts = cost.weight_bytes / 2**20, cost.expert_bytes / 2**20
    print(
        f"experts: {total} per MoE layer, {picked} per token; weights {dense:.1f} MiB dense, "
        f"{experts:.1f} MiB of experts"
    )
    for r in results:
        if r.experts_per_decode_step is None:
            continue
        read = cost.weight_bytes + per_expert * r.experts_per_decode_step
        print(
            f"  batch {r.batch_size}: {r.experts_per_decode_step:.1f} of {total} experts per layer "
            f"per decode step (uniform routing: {total * cost.expert_share(r.batch_size):.1f}); "
            f"weights read {read / 2**20:.1f} MiB per step, {read / r.batch_size / 2**20:.1f} "
            f"MiB per token (all experts: {(cost.weight_bytes + cost.expert_bytes) / 2**20:.1f})"
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        help="checkpoint directory, .gguf file or 'demo' (default: SmolLM2-135M-Instruct)",
    )
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--input-len", type=int, nargs="+", default=[128])
    parser.add_argument("--output-len", type=int, nargs="+", default=[64])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--quantization",
        default="auto",
        help="model.quantization: auto (a GGUF file's block types), none (dequantized), q8_0, "
        "q4_0, q4_1",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--kernel-backend", default="auto", help="auto, torch, triton (GPU), cpu, batch_invariant"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=int, help="bytes (default: a fraction of free)")
    parser.add_argument("--num-threads", type=int, help="torch intra-op threads (per rank)")
    parser.add_argument("--correct", action="store_true", help="print greedy text for prompts")
    parser.add_argument("--profile", action="store_true", help="trace a window of decode steps")
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--profile-out", default="bench_one_batch.trace.json.gz")


@dataclass
class Measured:
    """The cases measured on a runner of `model` (a checkpoint directory)."""

    runner: ModelRunner
    model: str
    results: list[CaseResult]


def run_step(args: argparse.Namespace) -> Measured | None:
    """The runner loaded and described, then --correct's texts, --profile's trace, or every case
    timed and printed against this machine's limits (None: nothing was timed)."""
    from engine.launch.model_source import model_directory
    from engine.settings.home import default_engine_home

    model, _ = model_directory(args.model, default_engine_home())
    runner = ModelRunner(
        model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        num_threads=args.num_threads,
        quantization=args.quantization,
        kernel_backend=args.kernel_backend,
    )
    print(
        f"model {model}: {runner.config.architecture}, {runner.dtype}, "
        f"weights {describe_formats(runner.model.weight_formats, str(runner.dtype))}, "
        f"{describe_threads(runner.threads)} threads, {runner.backend.name} kernels"
    )
    if args.correct:
        texts = greedy_texts(runner, CORRECTNESS_PROMPTS, args.output_len[0])
        for prompt, text in zip(CORRECTNESS_PROMPTS, texts, strict=True):
            print(f"{prompt!r} -> {text!r}")
        return None
    if args.profile:
        batch, length, steps = args.batch_size[-1], args.input_len[0], args.profile_steps
        profile_decode(runner, batch, length, steps, Path(args.profile_out))
        return None
    bench_case(runner, 1, 16, 4)  # warm-up: allocator, thread pool, first-call paths
    results = []
    for batch_size in args.batch_size:
        for input_len in args.input_len:
            for output_len in args.output_len:
                reason = fits(runner, batch_size, input_len + output_len)
                if reason:
                    print(f"skip batch {batch_size} in {input_len} out {output_len}: {reason}")
                    continue
                results.append(bench_case(runner, batch_size, input_len, output_len))
    # The limits are those of the most threads a step may use (a large step's matmuls, and the
    # CPU attention kernel's share of a long context): the machine the model gets at its best.
    most = runner.threads.busy if runner.threads is not None else torch.get_num_threads()
    before = torch.get_num_threads()
    torch.set_num_threads(most)
    rates = MachineRates.measure(runner.dtype, runner.device)
    torch.set_num_threads(before)
    print(f"limits: {rates.describe()}, {most} threads")
    print_table(results, runner, rates)
    return Measured(runner, model, results)


def main(argv: Sequence[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="engine bench step", description=__doc__.split("\n")[0] if __doc__ else None
    )
    add_arguments(parser)
    run_step(parser.parse_args(argv))
    return 0
