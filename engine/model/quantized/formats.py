"""Which weights a rank serves quantized, and in how many bits (torch-free: the root plans the
memory with it, the loader loads by it).

`model.quantization`:
- auto: a GGUF file's quantized tensors stay quantized (on the CPU, one rank); float checkpoints
  and float tensors stay float.
- none: everything is dequantized to the model's dtype (the float reference).
- a scheme (q8_0, q4_0, q4_1; int8 = q8_0, int4 = q4_0): every matmul and embedding weight is
  quantized at load into it, whatever the checkpoint holds.

Only the matmul weights (q|k|v, o, gate|up, down) and the embedding / output tables are ever
quantized; norms and biases stay float. Each GGUF type keeps its own width; a fused weight whose
parts have different types (a Q4_K_M file's q and k in Q4_K, v in Q6_K) keeps each part's
(engine/quantization/layout.py), and consecutive parts of one type are packed as one.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.gguf.native_blocks import NATIVE_TYPES
from engine.model.config import ModelConfig
from engine.model.loading.weight_names import map_weight_name, matrix_shapes
from engine.quantization.layout import packed_bytes
from engine.quantization.quantize import ALIASES, SCHEMES

# The packed format of each scheme's codes (every scheme of quantize.SCHEMES).
SCHEME_FORMATS = {"q8_0": "U8", "q4_0": "U4", "q4_1": "U4"}
CHOICES = ("auto", "none", *SCHEMES, *ALIASES)
QUANTIZABLE_SUFFIXES = (
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
    "mlp.experts.gate_up",
    "mlp.experts.down",
    "embed_tokens.weight",
    "lm_head.weight",
)


@dataclasses.dataclass(frozen=True)
class WeightFormat:
    parts: tuple[tuple[str, int], ...]  # (packed format, rows) of each part, in row order
    source: str  # what the codes come from: GGUF types ("Q4_1", "Q4_K+Q6_K") or the scheme
    scheme: str | None = None  # the scheme floats are quantized into; None: the file's codes

    def packed_bytes(self, k: int) -> int:
        """Bytes of the packed weight, whose rows are k values."""
        return sum(packed_bytes(rows, k, name) for name, rows in self.parts)


def grouped_parts(parts: list[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """(type, rows) of a weight's checkpoint parts in row order, consecutive ones of one type
    joined (what the loader packs as one part)."""
    grouped: list[tuple[str, int]] = []
    for name, rows in parts:
        if grouped and grouped[-1][0] == name:
            grouped[-1] = (name, grouped[-1][1] + rows)
        else:
            grouped.append((name, rows))
    return tuple(grouped)


def quantized_bytes(formats: dict[str, WeightFormat], config: ModelConfig) -> dict[str, int]:
    """Parameter name -> bytes of its packed weight."""
    shapes = matrix_shapes(config)
    return {name: f.packed_bytes(shapes[name][1]) for name, f in formats.items()}


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
        name = SCHEME_FORMATS[scheme]
        shapes = matrix_shapes(config)
        return {
            param: WeightFormat(((name, rows),), scheme, scheme)
            for param, (rows, _) in shapes.items()
        }
    gguf = gguf_file(model_path)
    return {} if gguf is None else _file_formats(gguf, config)


def quantized_gguf(
    model_path: str | Path, config: ModelConfig, quantization: str, tensor_parallel_size: int
) -> bool:
    """Whether a CPU rank serves a GGUF file's own quantized tensors (repacked, not read as
    floats): `auto`, one rank, a file with quantized tensors."""
    if scheme_of(quantization) != "auto" or tensor_parallel_size > 1:
        return False
    return bool(quantized_formats(model_path, config, quantization))


def _checkpoint_tensors(name: str | None, shape: tuple[int, ...]) -> list[tuple[str, int]]:
    """(Hugging Face name, rows) of each checkpoint tensor a GGUF tensor holds: one, or one per
    expert of a stacked [experts, rows, columns] tensor (engine/gguf/names.py)."""
    from engine.gguf.names import EXPERT

    if name is None:
        return []
    if EXPERT in name:
        return [(name.replace(EXPERT, str(e)), shape[1]) for e in range(shape[0])]
    return [(name, shape[0])]


def _file_formats(gguf: Path, config: ModelConfig) -> dict[str, WeightFormat]:
    from engine.gguf.names import hf_name
    from engine.gguf.reader import read_gguf

    # parameter -> {first row: (GGUF type, rows)} of its checkpoint parts
    parts: dict[str, dict[int, tuple[str, int]]] = {}
    with read_gguf(gguf) as file:
        arch = str(file.metadata.get("general.architecture", ""))
        for info in file.tensors.values():
            for name, rows in _checkpoint_tensors(hf_name(info.name, arch), info.shape):
                target = map_weight_name(name, config)
                if target is not None and target[0].endswith(QUANTIZABLE_SUFFIXES):
                    param, row = target
                    parts.setdefault(param, {})[row] = (info.type_name, rows)
    formats = {}
    for param, by_row in parts.items():
        types = [by_row[row] for row in sorted(by_row)]
        if all(t in NATIVE_TYPES for t, _ in types):
            source = "+".join(sorted({t for t, _ in types}))
            formats[param] = WeightFormat(grouped_parts(types), source)
    return formats


def describe_formats(formats: dict[str, WeightFormat], dtype: str) -> str:
    """What the weights are served as, in one line: "Q4_K x72, Q4_K+Q6_K x24, Q6_K x1 quantized
    (each type at its own width); the rest float32"."""
    if not formats:
        return f"all {dtype}"
    counts: dict[str, int] = {}
    for weight_format in formats.values():
        label = weight_format.source
        counts[label] = counts.get(label, 0) + 1
    kinds = ", ".join(f"{label} x{n}" for label, n in sorted(counts.items()))
    return f"{kinds} quantized (each type at its own width); the rest {dtype}"
