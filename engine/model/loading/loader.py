"""Build a model of its family (engine/model/architectures) from a Hugging Face checkpoint: dtype
choice, safetensors (single file or sharded) or a GGUF file (engine/gguf/weights.py, dequantized
as it is read), and the mapping from the checkpoint's tensor names onto our fused parameters.

A tensor-parallel rank reads only its part of each tensor (engine/model/parallel/sharding.py)
and places it by its own sizes (`RankShape`): the fused q|k|v rows of its heads, the gate|up
rows of its MLP columns."""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.kernels.backend import KernelBackend
from engine.model.architectures.decoder import CausalLM
from engine.model.architectures.families import model_class
from engine.model.config import ModelConfig
from engine.model.loading.weight_names import (
    expected_weight_keys,
    map_weight_name,
    matrix_shapes,
    parts_of,
)
from engine.model.loading.weight_store import LoadedWeights, StoreSlot
from engine.model.parallel.group import TensorParallelGroup
from engine.model.parallel.sharding import read_shard
from engine.model.placement import policy as placement
from engine.model.quantized.formats import WeightFormat, quantized_formats, scheme_of
from engine.quantization.codes import BlockCodes, concatenate

if TYPE_CHECKING:
    from engine.kernels.cpu.quantized import PackedWeight

log = logging.getLogger(__name__)

DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(requested: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    """The dtype to run in, by the placement rule (engine/model/placement/policy.py)."""
    return DTYPE_NAMES[placement.resolve_dtype(requested, config.torch_dtype, device.type)]


def load_model(
    model_path: str | Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    ops: KernelBackend,
    group: TensorParallelGroup | None = None,
    quantization: str = "auto",
    store: StoreSlot | None = None,
) -> CausalLM:
    """The model (this rank's shard of it) with every parameter filled from the checkpoint (no
    random init is spent). Weights served quantized (`quantization`, the model.quantization
    setting) are packed for the CPU kernel and never held as floats. With a `store`, the
    weights come from it when a predecessor stored them (the checkpoint is not read), and are
    stored there for the successors otherwise."""
    with torch.device("meta"):
        model = model_class(config)(config, ops, group)
    weights = store.load() if store is not None else None
    if weights is None:
        weights = read_weights(model, model_path, config, dtype, device, quantization)
        if store is not None:
            weights = store.save(weights)
    _install(model, weights)
    return model


def read_weights(
    model: CausalLM,
    model_path: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str,
) -> LoadedWeights:
    """Fill `model`'s parameters from the checkpoint; its tensors as `_install` takes them."""
    from engine.gguf.weights import GGUFTensors

    formats = _quantized_formats(model_path, config, quantization, device, model.shape.size)
    _materialize(model, dtype, device, empty=set(formats))
    shape = model.shape
    params = dict(model.named_parameters())
    filled: set[str] = set()
    ignored: list[str] = []
    parts: dict[str, dict[int, QuantizedPart]] = {}  # quantized parameter -> its parts by row
    packed: dict[str, PackedWeight] = {}
    with contextlib.ExitStack() as stack:
        # Every file open at once (memory-mapped, nothing read yet): one pass counts the tensors
        # for the progress bar and a second reads them, without parsing any header twice.
        opened = [stack.enter_context(open_tensors(f)) for f in checkpoint_files(Path(model_path))]
        total = sum(len(list(tensors.keys())) for tensors in opened)
        progress = stack.enter_context(
            tqdm(total=total, desc="loading weights", unit="tensor", file=sys.stderr)
        )
        for tensors in opened:
            offset_norms = config.norm_offset and not isinstance(tensors, GGUFTensors)
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not a dict)
                target = map_weight_name(name, config, shape)
                progress.update(1)
                if target is None or target[0] not in params:
                    ignored.append(name)
                    continue
                param_name, row_start = target
                if param_name in formats:
                    read = parts.setdefault(param_name, {})
                    read[row_start] = _read_part(tensors, name, formats[param_name])
                    if len(read) == parts_of(param_name, config):  # packed: parts live briefly
                        packed[param_name] = _pack(param_name, read, config)
                else:
                    tensor = read_shard(tensors, name, config, shape)
                    if offset_norms and param_name.endswith("norm.weight"):
                        tensor = tensor + 1.0  # Gemma's (1 + w), as llama.cpp's converter stores
                    _copy_into(params[param_name], row_start, tensor, name)
                filled.add(f"{param_name}@{row_start}")
    missing = sorted(set(expected_weight_keys(params, config, shape)) - filled)
    if missing:
        raise ValueError(f"checkpoint {str(model_path)!r} lacks weights: {', '.join(missing)}")
    if ignored:
        log.warning("ignored %d checkpoint tensors: %s", len(ignored), ", ".join(ignored[:8]))
    _zero_vocab_padding(model)
    return LoadedWeights({name: p.data for name, p in params.items()}, packed, formats)


def _install(model: CausalLM, weights: LoadedWeights) -> None:
    """Make `weights` the model's parameters (no copy) and prepare its matmuls."""
    modules = dict(model.named_modules())
    for full_name, _ in list(model.named_parameters()):
        module_name, _, name = full_name.rpartition(".")
        tensor = weights.params[full_name]
        setattr(modules[module_name], name, torch.nn.Parameter(tensor, requires_grad=False))
    model.fuse_weights(weights.packed)
    model.weight_formats = weights.formats
    model.eval()


def _quantized_formats(
    model_path: str | Path, config: ModelConfig, quantization: str, device: torch.device, tp: int
) -> dict[str, WeightFormat]:
    """The parameters to serve quantized; none where the CPU kernels cannot run (`auto`)."""
    formats = quantized_formats(
        model_path, config, quantization, tensor_parallel_size=tp, on_cpu=device.type == "cpu"
    )
    if not formats:
        return formats
    from engine.kernels.cpu.backend import unavailable_reason

    reason = unavailable_reason(device)
    if reason is None:
        return formats
    if scheme_of(quantization) != "auto":
        raise ValueError(f"quantization {quantization!r} needs the CPU kernels: {reason}")
    log.warning("serving the quantized weights dequantized: %s", reason)
    return {}


# A checkpoint tensor on its way to the kernel: a GGUF tensor's (type, bytes [rows, row bytes]),
# or a float tensor quantized by a scheme.
QuantizedPart = tuple[str, Any] | BlockCodes


def _read_part(tensors: Any, name: str, weight_format: WeightFormat) -> QuantizedPart:
    """A checkpoint tensor as the loader packs it: a GGUF block type's bytes as they are, or a
    float tensor quantized by the format's scheme."""
    from engine.gguf.weights import GGUFTensors
    from engine.quantization.quantize import quantize

    if weight_format.scheme is None:
        assert isinstance(tensors, GGUFTensors), f"{name}: codes come from GGUF files only"
        return tensors.raw_rows(name)
    weight = tensors.get_tensor(name).to(torch.float32).numpy()
    return quantize(weight, weight_format.scheme)


def _pack(param_name: str, parts: dict[int, QuantizedPart], config: ModelConfig) -> PackedWeight:
    """A quantized parameter's parts in row order, checked against config.json, packed:
    consecutive GGUF tensors of one type as one part, each type at its own width; codes
    quantized at load joined into one."""
    from engine.kernels.cpu.quantized import pack, pack_gguf, stacked

    ordered = [parts[row] for row in sorted(parts)]
    expected = matrix_shapes(config)[param_name]
    if all(isinstance(part, BlockCodes) for part in ordered):
        weight = pack(concatenate([p for p in ordered if isinstance(p, BlockCodes)]))
    else:
        groups: list[tuple[str, list[Any]]] = []
        for type_name, raw in (p for p in ordered if isinstance(p, tuple)):
            if groups and groups[-1][0] == type_name:
                groups[-1][1].append(raw)
            else:
                groups.append((type_name, [raw]))
        packed = []
        for type_name, raws in groups:
            joined = np.concatenate(raws) if len(raws) > 1 else raws[0]
            packed.append(pack_gguf(joined, type_name, (joined.shape[0], expected[1])))
        weight = stacked(packed)
    if (weight.rows, weight.k) != expected:
        raise ValueError(
            f"{param_name}: the checkpoint's quantized tensors make {(weight.rows, weight.k)}, "
            f"config.json says {expected}"
        )
    return weight


def _materialize(
    model: torch.nn.Module, dtype: torch.dtype, device: torch.device, empty: set[str]
) -> None:
    """Give every meta parameter uninitialised storage of `dtype` on `device`; the ones named in
    `empty` (served quantized) an empty [rows, 0] placeholder instead.

    What `model.to(dtype).to_empty(device)` does, without running an op on a meta tensor: those
    run through torch._refs, whose first use imports torch._dynamo and sympy (seconds of every
    worker start and restart).
    """
    for module_name, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{name}" if module_name else name
            shape = (param.shape[0], 0) if full_name in empty else param.shape
            storage = torch.empty(shape, dtype=dtype, device=device)
            setattr(module, name, torch.nn.Parameter(storage, requires_grad=False))


@contextlib.contextmanager
def open_tensors(file: Path) -> Iterator[Any]:
    """A weights file's tensors by checkpoint name: `keys()`, `get_tensor`, `get_slice`."""
    if file.suffix == ".gguf":
        from engine.gguf.reader import read_gguf
        from engine.gguf.weights import GGUFTensors

        with read_gguf(file) as gguf:
            yield GGUFTensors(gguf)
        return
    with safe_open(str(file), framework="pt", device="cpu") as tensors:
        yield tensors


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.gguf"))[:1]
    if not found:
        raise FileNotFoundError(
            f"no weights in {str(path)!r}: expected model.safetensors, "
            "model.safetensors.index.json with its shards, or a .gguf file"
        )
    return found


def _copy_into(param: torch.nn.Parameter, row_start: int, tensor: torch.Tensor, name: str) -> None:
    rows = tensor.shape[0]
    target = param.data[row_start : row_start + rows]
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; "
            f"expected {tuple(target.shape)} from config.json"
        )
    target.copy_(tensor)


def _zero_vocab_padding(model: CausalLM) -> None:
    """The last rank's vocabulary shard may end in padding rows no checkpoint row filled: zero
    them (their logits are cut off; zero keeps them finite)."""
    real = model.shape.vocab_end - model.shape.vocab_start
    for weight in (model.embed_tokens.weight, getattr(model.lm_head, "weight", None)):
        if weight is not None and real < weight.shape[0]:
            weight.data[real:].zero_()
