"""A bfloat16 checkpoint against the same model in float32 (issue 53): prefill and decode tokens/s
of the raw model (no scheduler, no processes) at 1 and 16 streams, in alternating rounds (every
other round the float32 model first), each round's bfloat16 / float32 ratio printed, and the
ranges over the rounds under the table. With --torch, the bfloat16 model on torch's own ops
(kernel_backend="torch": the engine's bfloat16 path before bf16_linear.cpp) runs in the same
rounds. The bfloat16 checkpoint is made once from the float32 one (every float tensor rounded to
bfloat16, config.json's torch_dtype set), as a Hugging Face bfloat16 checkpoint is.

    python tools/bench/bf16_dtype.py --model DIR                 # DIR: a float32 checkpoint
    python tools/bench/bf16_dtype.py --model DIR --torch --rounds 5
    # an AVX2 machine imitated on an AVX-512 one: the kernels built without AVX-512, torch's and
    # oneDNN's kernels held to AVX2 (no AMX then either)
    ENGINE_KERNEL_FLAGS=-mno-avx512f ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \\
        python tools/bench/bf16_dtype.py --model DIR

`engine export default DIR` writes the default model's float32 checkpoint.

--clock cpu (the default) runs every model on one thread and times it in the process's CPU
seconds, so that a shared machine's other work slows no model's figures (memory bandwidth and
caches still shared); --clock wall times wall-clock seconds on --threads threads.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `engine` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.model.placement.policy import sleeping_openmp_threads

sleeping_openmp_threads()  # as the engine's workers do; before torch loads OpenMP

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from engine.bench.raw_model import (  # noqa: E402
    greedy_pick,
    random_prompts,
    static_block_tables,
)
from engine.kernels.cpu import bf16_linear  # noqa: E402
from engine.kernels.packed_weights import packed_copies  # noqa: E402
from engine.model.runner import ModelRunner  # noqa: E402
from engine.model.step_inputs import SeqChunk  # noqa: E402

CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


def bfloat16_copy(source: Path, target: Path) -> Path:
    """`source` (a float32 checkpoint) as a bfloat16 one in `target`, made once."""
    if (target / "config.json").is_file():
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for item in source.iterdir():
        if item.suffix == ".safetensors":
            tensors = load_file(item)
            half = {k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()}
            save_file(half, staging / item.name, metadata={"format": "pt"})
        elif item.name == "config.json":
            config = json.loads(item.read_text())
            config["torch_dtype"] = "bfloat16"
            (staging / item.name).write_text(json.dumps(config, indent=2))
        elif item.is_file() and not item.name.endswith(".index.json"):
            shutil.copy(item, staging / item.name)
    staging.rename(target)
    return target


def tokens_per_second(
    runner: ModelRunner, batch: int, input_len: int, output_len: int, clock: Callable[[], float]
) -> tuple[float, float]:
    """Prefill of `batch` prompts in one step, then output_len - 1 decode steps: (prefill
    tokens/s, decode tokens/s) by `clock`."""
    tables = static_block_tables(runner, batch, input_len + output_len)
    pick = greedy_pick(runner)
    chunks = [
        SeqChunk(i, prompt, 0, table, True)
        for i, (prompt, table) in enumerate(
            zip(random_prompts(runner, batch, input_len), tables, strict=True)
        )
    ]
    start = clock()
    tokens = pick(runner.forward(chunks))
    prefill = clock() - start
    start = clock()
    for step in range(output_len - 1):
        chunks = [
            SeqChunk(i, [tokens[i]], input_len + step, table, True)
            for i, table in enumerate(tables)
        ]
        tokens = pick(runner.forward(chunks))
    decode = (clock() - start) / (output_len - 1)
    return batch * input_len / prefill, batch / decode


def machine() -> str:
    flags = ""
    with open("/proc/cpuinfo") as info:
        flags = next((line for line in info if line.startswith("flags")), "")
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    present = [flag for flag in wanted if flag in flags.split()]
    overrides = " ".join(
        f"{name}={os.environ[name]}"
        for name in (
            "ENGINE_KERNEL_FLAGS",
            "ENGINE_BF16_LINEAR_PATH",
            "ATEN_CPU_CAPABILITY",
            "ONEDNN_MAX_CPU_ISA",
        )
        if name in os.environ
    )
    amx = "yes" if packed_copies("bfloat16") > 1 else "no"
    return (
        f"CPU flags: {' '.join(present)}; {overrides or 'no overrides'}; bf16_linear path "
        f"{bf16_linear.chosen_path()}, oneDNN AMX copy {amx}; "
        f"torch {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads; "
        f"load {' '.join(f'{x:.1f}' for x in os.getloadavg())}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, type=Path, help="a float32 checkpoint")
    parser.add_argument("--bf16-dir", type=Path, help="where the bfloat16 copy goes")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--torch", action="store_true", help="also bfloat16 on torch's ops")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="with --clock wall")
    args = parser.parse_args()
    half_dir = bfloat16_copy(
        args.model, args.bf16_dir or args.model.with_name(args.model.name + "-bfloat16")
    )
    clock = CLOCKS[args.clock]
    common: dict[str, object] = {
        "kv_cache_memory": 512 << 20,  # a batch of 16 at the longest length, in float32
        "num_threads": 1 if args.clock == "cpu" else args.threads,
        "busy_threads": 1 if args.clock == "cpu" else args.threads,
    }
    runners = {
        "float32": ModelRunner(str(args.model), dtype="float32", **common),  # type: ignore[arg-type]
        "bfloat16": ModelRunner(str(half_dir), **common),  # type: ignore[arg-type]
    }
    if args.torch:
        runners["bf16-torch"] = ModelRunner(str(half_dir), kernel_backend="torch", **common)  # type: ignore[arg-type]
    assert runners["bfloat16"].dtype == torch.bfloat16  # the checkpoint's own dtype under auto
    print(machine())
    # (name, batch) -> per round: prefill tok/s, decode tok/s
    figures: dict[tuple[str, int], list[tuple[float, float]]] = {}
    print(f"clock: {args.clock}; {args.input_len} prompt tokens, {args.output_len} out")
    for runner in runners.values():  # warm-up, not reported
        tokens_per_second(runner, 1, 16, 3, clock)
    for round_ in range(args.rounds):
        order = list(runners) if round_ % 2 == 0 else list(reversed(runners))
        for name in order:
            for batch in args.batch_size:
                figure = tokens_per_second(
                    runners[name], batch, args.input_len, args.output_len, clock
                )
                figures.setdefault((name, batch), []).append(figure)
        for batch in args.batch_size:
            line = [f"round {round_ + 1} batch {batch:>2}:"]
            for name in runners:
                prefill, decode = figures[(name, batch)][-1]
                line.append(f"{name} prefill {prefill:7.1f} decode {decode:6.1f} tok/s;")
            print(" ".join(line), flush=True)
    print(f"ratios over float32 (lowest-highest over {args.rounds} rounds, median):")
    for name in runners:
        if name == "float32":
            continue
        for batch in args.batch_size:
            pairs = zip(figures[(name, batch)], figures[("float32", batch)], strict=True)
            ratios = [(p / fp, d / fd) for (p, d), (fp, fd) in pairs]
            summary = []
            for label, values in (
                ("prefill", [r[0] for r in ratios]),
                ("decode", [r[1] for r in ratios]),
            ):
                summary.append(
                    f"{label} {min(values):.2f}-{max(values):.2f} ({statistics.median(values):.2f})"
                )
            print(f"  {name} / float32, {batch} stream(s): {'; '.join(summary)} x tok/s")
    print(f"load at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
