"""Build a decoder from a Hugging Face checkpoint: dtype choice, safetensors (single file or
sharded) or a GGUF file (engine/gguf/weights.py, dequantized as it is read), and the mapping from
the checkpoint's tensor names onto our fused parameters.

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
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

from engine.kernels import KernelBackend
from engine.model import placement
from engine.model.config import ModelConfig
from engine.model.decoder import DecoderForCausalLM
from engine.model.parallel.group import TensorParallelGroup
from engine.model.parallel.layout import RankShape, rank_shape
from engine.model.parallel.sharding import read_shard

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
    """The dtype to run in, by the placement rule (engine/model/placement.py)."""
    return DTYPE_NAMES[placement.resolve_dtype(requested, config.torch_dtype, device.type)]


def load_model(
    model_path: str | Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    ops: KernelBackend,
    group: TensorParallelGroup | None = None,
) -> DecoderForCausalLM:
    """The model (this rank's shard of it) with every parameter filled from the checkpoint (no
    random init is spent)."""
    with torch.device("meta"):
        model = DecoderForCausalLM(config, ops, group)
    _materialize(model, dtype, device)
    shape = model.shape
    params = dict(model.named_parameters())
    filled: set[str] = set()
    ignored: list[str] = []
    with contextlib.ExitStack() as stack:
        # Every file open at once (memory-mapped, nothing read yet): one pass counts the tensors
        # for the progress bar and a second reads them, without parsing any header twice.
        opened = [stack.enter_context(open_tensors(f)) for f in checkpoint_files(Path(model_path))]
        total = sum(len(list(tensors.keys())) for tensors in opened)
        progress = stack.enter_context(
            tqdm(total=total, desc="loading weights", unit="tensor", file=sys.stderr)
        )
        for tensors in opened:
            for name in tensors.keys():  # noqa: SIM118 (safe_open is not a dict)
                target = map_weight_name(name, config, shape)
                progress.update(1)
                if target is None or target[0] not in params:
                    ignored.append(name)
                    continue
                param_name, row_start = target
                tensor = read_shard(tensors, name, config, shape)
                _copy_into(params[param_name], row_start, tensor, name)
                filled.add(f"{param_name}@{row_start}")
    missing = sorted(set(expected_weight_keys(params, config, shape)) - filled)
    if missing:
        raise ValueError(f"checkpoint {str(model_path)!r} lacks weights: {', '.join(missing)}")
    if ignored:
        log.warning("ignored %d checkpoint tensors: %s", len(ignored), ", ".join(ignored[:8]))
    _zero_vocab_padding(model)
    model.fuse_weights()
    model.eval()
    return model


def _materialize(model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Give every meta parameter uninitialised storage of `dtype` on `device`.

    What `model.to(dtype).to_empty(device)` does, without running an op on a meta tensor: those
    run through torch._refs, whose first use imports torch._dynamo and sympy (seconds of every
    worker start and restart).
    """
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            storage = torch.empty(param.shape, dtype=dtype, device=device)
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


def map_weight_name(
    name: str, config: ModelConfig, shape: RankShape | None = None
) -> tuple[str, int] | None:
    """(our parameter name, first row within it) for a checkpoint tensor; None to skip it.
    q/k/v land in row ranges of the fused qkv_proj, gate/up in gate_up_proj (this rank's sizes
    under tensor parallelism)."""
    name = name.removeprefix("model.")
    if "rotary_emb." in name:
        return None
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return None
    shape = shape or rank_shape(config, 0, 1)
    q_rows = shape.num_heads * config.head_dim
    kv_rows = shape.num_kv_heads * config.head_dim
    fused = {
        "self_attn.q_proj.": ("self_attn.qkv_proj.", 0),
        "self_attn.k_proj.": ("self_attn.qkv_proj.", q_rows),
        "self_attn.v_proj.": ("self_attn.qkv_proj.", q_rows + kv_rows),
        "mlp.gate_proj.": ("mlp.gate_up_proj.", 0),
        "mlp.up_proj.": ("mlp.gate_up_proj.", shape.intermediate_size),
    }
    for part, (fused_part, row_start) in fused.items():
        if part in name:
            return name.replace(part, fused_part), row_start
    return name, 0


def expected_weight_keys(
    params: dict[str, torch.nn.Parameter], config: ModelConfig, shape: RankShape | None = None
) -> list[str]:
    """Every `param@row_start` piece the checkpoint has to provide."""
    shape = shape or rank_shape(config, 0, 1)
    q_rows = shape.num_heads * config.head_dim
    kv_rows = shape.num_kv_heads * config.head_dim
    keys = []
    for name in params:
        if ".qkv_proj." in name:
            keys += [f"{name}@0", f"{name}@{q_rows}", f"{name}@{q_rows + kv_rows}"]
        elif ".gate_up_proj." in name:
            keys += [f"{name}@0", f"{name}@{shape.intermediate_size}"]
        else:
            keys.append(f"{name}@0")
    return keys


def _copy_into(param: torch.nn.Parameter, row_start: int, tensor: torch.Tensor, name: str) -> None:
    rows = tensor.shape[0]
    target = param.data[row_start : row_start + rows]
    if target.shape != tensor.shape:
        raise ValueError(
            f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; "
            f"expected {tuple(target.shape)} from config.json"
        )
    target.copy_(tensor)


def _zero_vocab_padding(model: DecoderForCausalLM) -> None:
    """The last rank's vocabulary shard may end in padding rows no checkpoint row filled: zero
    them (their logits are cut off; zero keeps them finite)."""
    real = model.shape.vocab_end - model.shape.vocab_start
    for weight in (model.embed_tokens.weight, getattr(model.lm_head, "weight", None)):
        if weight is not None and real < weight.shape[0]:
            weight.data[real:].zero_()
