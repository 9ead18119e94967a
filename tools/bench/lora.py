"""Decode tokens/s of one batch with 0, 1, 2, 4 distinct LoRA adapters, against the base-only
batch of the same run (the raw model: no scheduler, no processes, as tools/bench/one_batch.py).

Random PEFT-format adapters (every projection, rank --rank) are written to a temporary
directory for the model's shapes. A step with an adapter runs the decoder layer by layer, where a
base-only decode step on the compiled CPU backend runs them all in one C++ call (fused decode):
the row "0, layers" is the base batch made to take the layers too, which splits the cost into
that part and the adapters' own matmuls. Each case prefills the batch (untimed), then times --steps
decode steps; rounds alternate the cases so that a change of the machine's load hits them alike,
and the ratio printed is each case's median step time over the base case's in the same round.

    python tools/bench/lora.py                       # the default model, batch 8
    python tools/bench/lora.py --model demo --batch-size 16 --rank 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `engine` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.model.placement.policy import sleeping_openmp_threads

sleeping_openmp_threads()  # as the engine's workers do; before torch loads OpenMP

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from engine.bench.raw_model import random_prompts, static_block_tables  # noqa: E402
from engine.messages.params import LoRARequest  # noqa: E402
from engine.model.config import ModelConfig  # noqa: E402
from engine.model.lora.files import SUPPORTED_MODULES, module_shapes  # noqa: E402
from engine.model.runner import ModelRunner, describe_threads  # noqa: E402
from engine.model.step_inputs import SeqChunk  # noqa: E402

ADAPTER_COUNTS = (0, 1, 2, 4)
LAYERS = -1  # the base-only batch through the layers (no fused decode)
CASES = (0, LAYERS, 1, 2, 4)


def write_adapter(config: ModelConfig, rank: int, seed: int, directory: Path) -> Path:
    """A random adapter of every projection, in PEFT's file format."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (in_features, out_features) in module_shapes(config).items():
            part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.01 * torch.randn(
                rank, in_features, generator=generator
            )
            tensors[f"{prefix}.lora_B.weight"] = 0.01 * torch.randn(
                out_features, rank, generator=generator
            )
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(SUPPORTED_MODULES),
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config))
    return directory


def decode_seconds(
    runner: ModelRunner,
    loras: Sequence[LoRARequest | None],
    prompts: Sequence[list[int]],
    steps: int,
) -> float:
    """Median seconds of one decode step of the batch, each sequence with its adapter."""
    input_len = len(prompts[0])
    tables = static_block_tables(runner, len(prompts), input_len + steps + 1)
    chunks = [
        SeqChunk(i, p, 0, t, True, lora=lora)
        for i, (p, t, lora) in enumerate(zip(prompts, tables, loras, strict=True))
    ]
    tokens = runner.backend.argmax_rows(runner.forward(chunks)).tolist()
    seconds = []
    for step in range(steps):
        chunks = [
            SeqChunk(i, [tokens[i]], input_len + step, table, True, lora=lora)
            for i, (table, lora) in enumerate(zip(tables, loras, strict=True))
        ]
        began = time.perf_counter()
        tokens = runner.backend.argmax_rows(runner.forward(chunks)).tolist()
        seconds.append(time.perf_counter() - began)
    return statistics.median(seconds)


def batch_adapters(
    adapters: Sequence[LoRARequest], count: int, batch: int
) -> list[LoRARequest | None]:
    """Each sequence's adapter: none for count 0, else the `count` adapters in turn."""
    return [None if count == 0 else adapters[i % count] for i in range(batch)]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint, GGUF or 'demo'; unset: default")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16, help="timed decode steps per case")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--kernel-backend", default="auto")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    from engine.launch.model_source import model_directory
    from engine.settings.home import default_engine_home

    model, _ = model_directory(args.model, default_engine_home())
    runner = ModelRunner(
        model,
        kernel_backend=args.kernel_backend,
        kv_cache_memory=256 * 2**20,
        max_lora_rank=args.rank,
        max_cpu_loras=max(ADAPTER_COUNTS),
    )
    print(
        f"model {model}: {runner.config.architecture}, {runner.dtype}, "
        f"{describe_threads(runner.threads)} threads, {runner.backend.name} kernels; batch "
        f"{args.batch_size}, {args.input_len} prompt tokens, rank {args.rank}, every projection"
    )
    prompts = random_prompts(runner, args.batch_size, args.input_len)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as work:
        adapters = [
            LoRARequest(
                f"a{i}",
                i + 1,
                str(write_adapter(runner.config, args.rank, i, Path(work) / f"a{i}")),
            )
            for i in range(max(ADAPTER_COUNTS))
        ]
        seconds = run_rounds(runner, adapters, prompts, args)
    print("adapters   decode tok/s  vs base (median of rounds; per round)")
    for case in CASES:
        rate = args.batch_size / statistics.median(seconds[case])
        ratios = [base / mine for base, mine in zip(seconds[0], seconds[case], strict=True)]
        per_round = " ".join(f"{r:.2f}" for r in ratios)
        label = "0, layers" if case == LAYERS else str(case)
        print(f"{label:>9}  {rate:12.1f}  {statistics.median(ratios):.2f}x ({per_round})")


def run_rounds(
    runner: ModelRunner,
    adapters: Sequence[LoRARequest],
    prompts: Sequence[list[int]],
    args: argparse.Namespace,
) -> dict[int, list[float]]:
    """Each case's median decode step seconds, per round."""
    seconds: dict[int, list[float]] = {case: [] for case in CASES}
    fused = runner.model.fused_decode
    decode_seconds(runner, batch_adapters(adapters, 4, args.batch_size), prompts, 2)  # warm-up
    for _ in range(args.rounds):
        for case in CASES:
            runner.model.fused_decode = None if case == LAYERS else fused
            loras = batch_adapters(adapters, max(case, 0), args.batch_size)
            seconds[case].append(decode_seconds(runner, loras, prompts, args.steps))
    runner.model.fused_decode = fused
    return seconds


if __name__ == "__main__":
    main()
