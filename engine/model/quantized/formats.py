"""Which weights a rank serves quantized, and in how many bits (torch-free: the root plans the
memory with it, the loader loads by it).

`model.quantization`:
- auto: a GGUF file's quantized tensors stay quantized (on the CPU, one rank); float checkpoints
  and float tensors stay float.
- none: everything is dequantized to the model's dtype (the float reference).
- a scheme (q8_0, q4_0, q4_1; int8 = q8_0, int4 = q4_0): every matmul and embedding weight is
  quantized at load into it, whatever the checkpoint holds.

Only the matmul weights (q|k|v, o, gate|up, down) and the embedding / output tables are ever
quantized; norms and biases stay float. A fused weight whose parts have different widths (a
Q4_K_M file's q and k in Q4_K, v in Q6_K) takes 8-bit codes: 4-bit codes widen exactly.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.gguf.block_codes import CONVERSIONS
from engine.model.config import ModelConfig
from engine.model.loading.weight_names import map_weight_name, matrix_shapes
from engine.quantization.quantize import ALIASES, SCHEMES

# GGUF block types the kernels serve, by the width of the codes they map onto (Q6_K's 16-value
# scales are re-quantized to 8 bits per 32 values).
TYPE_BITS = {name: conversion.bits for name, conversion in CONVERSIONS.items()}
SCHEME_BITS = {"q8_0": 8, "q4_0": 4, "q4_1": 4}  # every scheme of quantize.SCHEMES
CHOICES = ("auto", "none", *SCHEMES, *ALIASES)
QUANTIZABLE_SUFFIXES = (
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
    "embed_tokens.weight",
    "lm_head.weight",
)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    bits: int  # width of the packed codes
    source: str  # what the codes come from: GGUF types ("Q4_1", "Q4_K+Q6_K") or the scheme
    scheme: str | None = None  # the scheme floats are quantized into; None: the file's codes


def scheme_of(quantization: str) -> str:
    """The canonical name of a `model.quantization` value; ValueError naming the choices."""
    if quantization not in CHOICES:
        raise ValueError(
            f"unknown quantization {quantization!r}; expected one of {', '.join(CHOICES)}"
        )
    return ALIASES.get(quantization, quantization)


def gguf_file(model_path: str | Path) -> Path | None:
    """The GGUF file a model directory serves, if it is a GGUF-derived one."""
    found = sorted(Path(model_path).glob("*.gguf"))
    has_safetensors = any(Path(model_path).glob("*.safetensors"))
    return found[0] if found and not has_safetensors else None


def quantized_formats(
    model_path: str | Path,
    config: ModelConfig,
    quantization: str,
    *,
    tensor_parallel_size: int = 1,
    on_cpu: bool = True,
) -> dict[str, WeightFormat]:
    """Parameter name (the decoder's: "layers.0.self_attn.qkv_proj.weight") -> its format, for
    every parameter served quantized; the others stay float."""
    scheme = scheme_of(quantization)
    if scheme == "none":
        return {}
    if scheme != "auto" and (tensor_parallel_size > 1 or not on_cpu):
        raise ValueError(
            f"quantization {quantization!r} runs on the CPU with one rank (tensor parallelism "
            f"and GPUs serve float weights); use --quantization none"
        )
    if tensor_parallel_size > 1 or not on_cpu:
        return {}
    if scheme != "auto":
        bits = SCHEME_BITS[scheme]
        return {name: WeightFormat(bits, scheme, scheme) for name in matrix_shapes(config)}
    gguf = gguf_file(model_path)
    return {} if gguf is None else _file_formats(gguf, config)


def _file_formats(gguf: Path, config: ModelConfig) -> dict[str, WeightFormat]:
    from engine.gguf.names import hf_name
    from engine.gguf.reader import read_gguf

    parts: dict[str, list[str]] = {}  # parameter -> the GGUF types of its checkpoint parts
    with read_gguf(gguf) as file:
        for info in file.tensors.values():
            name = hf_name(info.name)
            target = None if name is None else map_weight_name(name, config)
            if target is not None and target[0].endswith(QUANTIZABLE_SUFFIXES):
                parts.setdefault(target[0], []).append(info.type_name)
    formats = {}
    for param, types in parts.items():
        if all(t in TYPE_BITS for t in types):
            source = "+".join(sorted(set(types)))
            formats[param] = WeightFormat(max(TYPE_BITS[t] for t in types), source)
    return formats


def describe_formats(formats: dict[str, WeightFormat], dtype: str) -> str:
    """What the weights are served as, in one line: "Q4_1 x120, Q8_0 x1 quantized; the rest
    float32"."""
    if not formats:
        return f"all {dtype}"
    counts: dict[str, int] = {}
    for weight_format in formats.values():
        label = f"{weight_format.source} ({weight_format.bits}-bit codes)"
        counts[label] = counts.get(label, 0) + 1
    kinds = ", ".join(f"{label} x{n}" for label, n in sorted(counts.items()))
    return f"{kinds} quantized; the rest {dtype}"
