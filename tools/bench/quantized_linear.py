"""The quantized CPU matmul (engine/kernels/cpu/quantized_linear.cpp) against the float32 one
(linear.cpp) on SmolLM2-135M's shapes (or SmolLM2-1.7B's: --model 1.7b), at a decode step's 1
row, 16 rows and a prompt chunk's 256.

    python tools/bench/quantized_linear.py                      # 1 and 2 threads, every shape
    python tools/bench/quantized_linear.py --threads 1 --rows 1 --shapes qkv down
    python tools/bench/quantized_linear.py --model 1.7b --formats Q4_K Q6_K --rows 1 8 16

For each shape, packed format (--formats: GGUF block types at their own widths, U4 / U8 for
weights quantized at load), row count and thread count: microseconds per call, the weight's
bytes over that time (GB/s: what a decode step's matmuls are bounded by), and the float32
kernel's time over the quantized one's (above 1: the quantized kernel is faster). The two kernels
are timed in alternation, best of --rounds, so that a busy machine slows both alike. Weights are
random valid blocks (timing does not depend on the values); the float32 kernel gets their
dequantized values.

At 256 rows the alternative to int8 activations (dequantize the weight to float32 and run the
float32 kernel) is also costed: its float32 matmul alone is a lower bound on it, and adding one
pass of decoding the weight (engine_quantized_rows over every row, a plain loop: pessimistic)
estimates a version that dequantizes tile by tile. The lines under each shape say which wins.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

if __package__ in (None, ""):  # run as a script: make `engine` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.gguf.quants import layout as block_layout
from engine.gguf.quants import row_nbytes
from engine.kernels.cpu import linear, quantized
from engine.quantization.codes import BlockCodes

# Byte offsets of each type's float16 scales in its block: set to finite values (random bytes
# there could be subnormal or NaN).
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "IQ4_NL": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_XS": (0,),
}


@dataclass(frozen=True)
class Shape:
    name: str
    n: int  # output columns: the weight's rows
    k: int


MODELS = {
    "135m": (
        Shape("qkv", 960, 576),
        Shape("o", 576, 576),
        Shape("gate|up", 3072, 576),
        Shape("down", 576, 1536),
        Shape("vocab", 49152, 576),
    ),
    "1.7b": (
        Shape("qkv", 6144, 2048),
        Shape("o", 2048, 2048),
        Shape("gate|up", 16384, 2048),
        Shape("down", 2048, 8192),
        Shape("vocab", 49152, 2048),
    ),
}
DEFAULT_FORMATS = {"135m": ("U4", "U8", "Q4_1", "Q8_0"), "1.7b": ("Q4_K", "Q6_K", "Q8_0")}
PROMPT_ROWS = 256  # where the dequantize-then-float32 alternative is costed


def random_weight(shape: Shape, format_name: str) -> tuple[quantized.PackedWeight, np.ndarray]:
    """Random valid blocks of the format (U4 / U8: random codes), packed, and their values."""
    generator = np.random.default_rng(shape.n * 7 + len(format_name))
    if format_name in ("U4", "U8"):
        bits = 4 if format_name == "U4" else 8
        blocks = shape.k // 32
        codes = BlockCodes(
            bits=bits,
            codes=generator.integers(0, 1 << bits, size=(shape.n, shape.k), dtype=np.uint8),
            scales=(generator.random((shape.n, blocks), dtype=np.float32) * 0.01),
            mins=(generator.standard_normal((shape.n, blocks)).astype(np.float32) * 0.05),
            source=f"random {bits}-bit",
        )
        return quantized.pack(codes), codes.dequantize()
    size = shape.n * row_nbytes(format_name, shape.k)
    raw = generator.integers(0, 256, size=size, dtype=np.uint8)
    blocks = raw.reshape(-1, block_layout(format_name).type_size)
    for at in FP16_FIELDS[format_name]:
        scales = generator.uniform(0.001, 0.01, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8)
    part = quantized.pack_gguf(raw, format_name, (shape.n, shape.k))
    weight = quantized.PackedWeight((part,))
    values = quantized.embedding_rows(weight, torch.arange(shape.n)).numpy()
    return weight, values


def best_us(calls: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Microseconds per call of each, the best of `rounds` rounds taken in alternation; a round
    repeats a call for at least ~20 ms."""
    repeats = {}
    for name, call in calls.items():
        call()  # warm: the activation buffers, the pool's threads, the caches
        start = time.perf_counter()
        call()
        repeats[name] = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            for _ in range(repeats[name]):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / repeats[name] * 1e6)
    return best


def verdict(int8: float, float_alone: float, with_decoding: float) -> str:
    if int8 < float_alone:
        return "int8 activations win"
    if int8 < with_decoding:
        return "close: int8 activations lose to float32 alone, win against it plus decoding"
    return "dequantizing wins"


def bench_shape(
    shape: Shape, formats: list[str], rows: list[int], rounds: int, threads: int
) -> list[str]:
    """The table's lines for one shape, and a line on the prompt alternative per format."""
    lines, notes = [], []
    float_kernel: Callable[..., torch.Tensor] | None = None
    float_bytes = -(-shape.n // 16) * 16 * shape.k * 4  # its panels, rows rounded up to 16
    for format_name in formats:
        weight, values = random_weight(shape, format_name)
        if float_kernel is None:  # the same for every format: the timing ignores the values
            float_kernel = linear.panel_linear(torch.from_numpy(values))
            assert float_kernel is not None
        f32 = float_kernel
        for m in rows:
            x = torch.randn(m, shape.k)
            calls: dict[str, Callable[[], object]] = {
                "q": functools.partial(quantized.quantized_linear, x, weight),
                "f32": functools.partial(f32, x),
            }
            times = best_us(calls, rounds)
            lines.append(
                f"{shape.name:>8} {shape.n:>6} x {shape.k:<5} {format_name:>6} {m:>4} {threads:>3}"
                f" {times['q']:>10.1f} {weight.nbytes / times['q'] / 1e3:>7.1f}"
                f" {times['f32']:>10.1f} {float_bytes / times['f32'] / 1e3:>7.1f}"
                f" {times['f32'] / times['q']:>7.2f}"
            )
            if m == PROMPT_ROWS:
                ids = torch.arange(shape.n)
                every_row = functools.partial(quantized.embedding_rows, weight, ids)
                decode = best_us({"rows": every_row}, rounds)
                estimate = decode["rows"] + times["f32"]
                notes.append(
                    f"{shape.name} {format_name}, {m} rows, {threads} thread(s): int8 activations"
                    f" {times['q']:.0f} us; dequantize + float32 >= {times['f32']:.0f} us"
                    f" (float32 alone), ~{estimate:.0f} us with one decoding pass"
                    f" ({decode['rows']:.0f} us): {verdict(times['q'], times['f32'], estimate)}"
                )
    return lines + [f"  {note}" for note in notes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, PROMPT_ROWS])
    parser.add_argument("--model", choices=list(MODELS), default="135m")
    parser.add_argument("--shapes", nargs="+", choices=[s.name for s in MODELS["135m"]])
    parser.add_argument("--formats", nargs="+", choices=list(quantized.layout.FORMATS))
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    shapes = [s for s in MODELS[args.model] if args.shapes is None or s.name in args.shapes]
    formats = args.formats or list(DEFAULT_FORMATS[args.model])
    print(f"paths on this CPU: {', '.join(quantized.available_paths())} (the last one runs)")
    print(
        f"{'shape':>8} {'n':>6} x {'k':<5} {'codes':>6} {'rows':>4} {'thr':>3}"
        f" {'quant us':>10} {'GB/s':>7} {'f32 us':>10} {'GB/s':>7} {'f32/q':>7}"
    )
    before = torch.get_num_threads()
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for shape in shapes:
                for line in bench_shape(shape, formats, args.rows, args.rounds, threads):
                    print(line, flush=True)
    finally:
        torch.set_num_threads(before)


if __name__ == "__main__":
    main()
