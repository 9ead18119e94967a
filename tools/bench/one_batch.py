"""Static-batch latency of the raw model (no scheduler, no processes), as SGLang's bench_one_batch.

For each (batch size, input length, output length): prefill the whole batch in one step, then
decode output_len - 1 steps; report prefill latency and throughput, median decode step latency
and decode throughput, each next to this machine's limit for that step (tools/bench/step_limits.py:
bytes read over the measured memory bandwidth, FLOPs over the measured matmul rate). A warm-up
case runs first and is not reported; cases whose KV cache would not fit are skipped with a note.

    python tools/bench/one_batch.py --batch-size 1 32 --input-len 128 --output-len 64
    python tools/bench/one_batch.py --correct            # greedy text for a few real prompts
    python tools/bench/one_batch.py --profile            # torch profiler trace of decode steps
    python tools/bench/one_batch.py --compare-hf         # HF generate on the same batches
    python tools/bench/one_batch.py --tp 2 --dp 2        # also on 2 x 2 rank processes
    python tools/bench/one_batch.py --batch-size 1 --llama-bench   # beside llama.cpp's pp / tg

With --tp or --dp above 1 the same cases also run on tp x dp rank processes (each replica a share
of the batch; tools/bench/parallel_batch.py), printed against the TP=1 / DP=1 figures of the same
run.
With --llama-bench, llama.cpp's `llama-bench -t 2 -p 256 -n 128` on the same GGUF file
(tools/peers/llamacpp_peer.py builds it once) runs before ours, and is printed beside our batch-1
case of 256 in / 128 out: prompt processing and decode tokens/s and the ratios
(--llama-bench-prompt 512: pp512 and a 512-token prompt).

The timing functions (`prefill_batch`, `raw_decode_step_seconds`, `bench_case`) live in
tools/bench/raw_model.py, for other benchmarks to import.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make `engine` and `tools` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.model.placement.policy import sleeping_openmp_threads

sleeping_openmp_threads()  # as the engine's workers do; before torch loads OpenMP

import torch  # noqa: E402

from engine.bench.raw_model import (  # noqa: E402
    CaseResult,
    bench_case,
    blocks_per_sequence,
    random_prompts,
    raw_decode_step_seconds,
)
from engine.bench.step import add_arguments, run_step  # noqa: E402
from engine.model.placement.capacity import kv_block_bytes  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402


def hf_generate_seconds(
    model_path: str, prompts: Sequence[list[int]], output_len: int, hf_model: Any = None
) -> float:
    """Seconds transformers' generate(do_sample=False) takes for the same static batch."""
    from transformers import AutoModelForCausalLM

    model = hf_model or AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    ids = torch.tensor(prompts, device=model.device)
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
        )
        out.tolist()  # waits for a GPU's queued work
        return time.perf_counter() - start


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument(
        "--tp", type=int, default=1, help="also run each case on this many TP ranks per replica"
    )
    parser.add_argument(
        "--dp", type=int, default=1, help="... and this many replicas, each a share of the batch"
    )
    parser.add_argument(
        "--compare-hf", action="store_true", help="also time HF generate on the same batches"
    )
    parser.add_argument(
        "--llama-bench",
        action="store_true",
        help="also run llama.cpp's llama-bench (pp256, tg128, 2 threads) on the same GGUF file",
    )
    parser.add_argument(
        "--llama-bench-prompt",
        type=int,
        default=256,
        help="the prompt of the llama-bench comparison (default 256: pp256)",
    )
    parser.add_argument(
        "--no-engine-overhead",
        dest="engine_overhead",
        action="store_false",
        help="skip timing decode steps through the full actor system",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    # llama-bench runs first, while this process has no threads of its own: torch's and the
    # kernels' idle workers would take cores from it.
    prompt = args.llama_bench_prompt
    llama_rates = run_llama_bench(args.model, prompt) if args.llama_bench else None
    measured = run_step(args)
    if measured is None:
        return
    runner, model, results = measured.runner, measured.model, measured.results
    if (args.tp > 1 or args.dp > 1) and results:
        print_parallel(runner, model, results, args)
    if args.engine_overhead and results:
        print_engine_overhead(runner, model, results, args)
    if args.compare_hf:
        compare_with_hf(runner, results)
    if llama_rates is not None:
        compare_with_llama_bench(runner, llama_rates, prompt)


def print_parallel(
    runner: ModelRunner, model: str, results: list[CaseResult], args: argparse.Namespace
) -> None:
    """The same cases on --tp x --dp rank processes, against the TP=1 / DP=1 figures above."""
    from tools.bench.parallel_batch import parallel_cases, shares

    cases = [(r.batch_size, r.input_len, r.output_len) for r in results]
    num_blocks = max(
        blocks_per_sequence(runner, 20),  # the warm-up case
        *(shares(b, args.dp)[0] * blocks_per_sequence(runner, i + o) for b, i, o in cases),
    )
    split = parallel_cases(
        model,
        args.tp,
        args.dp,
        cases,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=num_blocks,
        num_threads=args.num_threads,
    )
    print(
        f"\nTP={args.tp} x DP={args.dp} ({args.tp * args.dp} processes); "
        "ratio: throughput over TP=1 / DP=1 above (> 1: faster)"
    )
    print(
        f"{'batch':>5} {'in':>5} {'out':>5} | {'prefill tok/s':>13} {'ratio':>6} | "
        f"{'decode ms/step':>14} {'decode tok/s':>12} {'ratio':>6} | {'total s':>7} {'ratio':>6}"
    )
    for one, many in zip(results, split, strict=True):
        print(
            f"{many.batch_size:>5} {many.input_len:>5} {many.output_len:>5} | "
            f"{many.prefill_tokens_per_second:>13.0f} "
            f"{many.prefill_tokens_per_second / one.prefill_tokens_per_second:>6.2f} | "
            f"{many.decode_step_seconds * 1e3:>14.3f} {many.decode_tokens_per_second:>12.0f} "
            f"{many.decode_tokens_per_second / one.decode_tokens_per_second:>6.2f} | "
            f"{many.total_seconds:>7.3f} {one.total_seconds / many.total_seconds:>6.2f}"
        )


def print_engine_overhead(
    runner: ModelRunner, model: str, results: list[CaseResult], args: argparse.Namespace
) -> None:
    """A decode step through the whole actor system over the raw forward of the same batch."""
    from tools.bench.engine_overhead import engine_decode_step_seconds

    cases = sorted({(r.batch_size, r.input_len) for r in results})
    output_len = max(args.output_len)
    kv_bytes = runner.num_blocks * kv_block_bytes(
        runner.config, runner.block_size, runner.kv_cache_dtype
    )
    engine = engine_decode_step_seconds(
        model, cases, output_len, kv_bytes, args.num_threads, runner_settings(runner, args)
    )
    print(f"\n{'batch':>5} {'in':>5} | {'engine ms/step':>14} {'raw ms/step':>11} {'overhead':>8}")
    for batch, input_len in cases:
        raw = raw_decode_step_seconds(runner, batch, input_len + output_len // 2)
        step = engine[(batch, input_len)]
        print(
            f"{batch:>5} {input_len:>5} | {step * 1e3:>14.3f} {raw * 1e3:>11.3f} {step / raw:>8.2f}"
        )


def runner_settings(runner: ModelRunner, args: argparse.Namespace) -> dict[str, object]:
    """The actor system's model settings for what the raw runner above ran."""
    return {
        "model.device": runner.device.type,
        "model.dtype": str(runner.dtype).removeprefix("torch."),
        "model.kernel_backend": args.kernel_backend,
        "model.quantization": args.quantization,
    }


def run_llama_bench(model: str | None, prompt: int = 256) -> dict[str, float]:
    """llama-bench's pp<prompt> / tg128 tokens/s on the GGUF file --model names (or the
    default's)."""
    from tools.peers import llamacpp_peer

    return llamacpp_peer.llama_bench(llamacpp_peer.model_file(model), prompt=prompt, generate=128)


def compare_with_llama_bench(
    runner: ModelRunner, theirs: dict[str, float], prompt: int = 256
) -> None:
    """Our batch-1 prefill of `prompt` tokens and decode of 128 beside llama-bench's
    pp<prompt> / tg128 (ours decodes after the prompt, llama-bench's tg after none)."""
    ours = bench_case(runner, 1, prompt, 128)
    print("\nllama-bench -t 2, run before ours, same file; ratio: ours / llama.cpp")
    print(f"{'test':>6} | {'ours tok/s':>10} {'llama.cpp tok/s':>15} {'ratio':>6}")
    for test, rate in (
        (f"pp{prompt}", ours.prefill_tokens_per_second),
        ("tg128", ours.decode_tokens_per_second),
    ):
        peer = theirs[test[:2]]
        print(f"{test:>6} | {rate:>10.1f} {peer:>15.1f} {rate / peer:>6.2f}")


def compare_with_hf(runner: ModelRunner, results: list[CaseResult]) -> None:
    """Whole-batch throughput (prefill + decode) of ours and of HF generate, side by side: HF in
    float32 on the CPU (its fastest there), in our dtype on a GPU."""
    from transformers import AutoModelForCausalLM

    on_gpu = runner.device.type == "cuda"
    hf = AutoModelForCausalLM.from_pretrained(
        runner.model_path, dtype=runner.dtype if on_gpu else torch.float32
    )
    hf = hf.to(runner.device).eval()
    hf_generate_seconds(runner.model_path, random_prompts(runner, 1, 16), 4, hf)  # warm-up
    print(f"\n{'batch':>5} {'in':>5} {'out':>5} | {'ours tok/s':>10} {'HF tok/s':>9} {'ratio':>6}")
    for r in results:
        prompts = random_prompts(runner, r.batch_size, r.input_len)
        hf_seconds = hf_generate_seconds(runner.model_path, prompts, r.output_len, hf)
        ours = r.batch_size * r.output_len / r.total_seconds
        theirs = r.batch_size * r.output_len / hf_seconds
        print(
            f"{r.batch_size:>5} {r.input_len:>5} {r.output_len:>5} | "
            f"{ours:>10.0f} {theirs:>9.0f} {ours / theirs:>6.2f}"
        )


if __name__ == "__main__":
    main()
