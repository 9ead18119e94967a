"""Which part of each checkpoint tensor a tensor-parallel rank loads.

Read through safetensors' lazy slices, so a rank reads its own rows or columns from the file and
never the whole tensor. Names are the checkpoint's (`model.layers.0.self_attn.q_proj.weight`).
"""

from __future__ import annotations

from typing import Any, cast

import torch

from engine.model.config import ModelConfig
from engine.model.parallel.layout import RankShape

# (name fragment, dimension split, which range of the RankShape) for every split tensor;
# anything else (norms, o_proj / down_proj biases, rotary buffers) is whole on every rank.
_ROWS, _COLUMNS = 0, 1


def split_of(name: str, config: ModelConfig, shape: RankShape) -> tuple[int, int, int] | None:
    """(dimension, start, length) of this rank's part of checkpoint tensor `name`; None: whole."""
    if shape.size == 1:
        return None
    head_dim = config.head_dim
    heads = (shape.head_start * head_dim, shape.num_heads * head_dim)
    kv_heads = (shape.kv_head_start * head_dim, shape.num_kv_heads * head_dim)
    columns = (shape.intermediate_start, shape.intermediate_size)
    vocab = (shape.vocab_start, shape.vocab_end - shape.vocab_start)
    splits: dict[str, tuple[int, tuple[int, int]]] = {
        "self_attn.q_proj.": (_ROWS, heads),
        "self_attn.k_proj.": (_ROWS, kv_heads),
        "self_attn.v_proj.": (_ROWS, kv_heads),
        "self_attn.o_proj.weight": (_COLUMNS, heads),
        "mlp.gate_proj.": (_ROWS, columns),
        "mlp.up_proj.": (_ROWS, columns),
        "mlp.down_proj.weight": (_COLUMNS, columns),
        "embed_tokens.weight": (_ROWS, vocab),
        "lm_head.weight": (_ROWS, vocab),
    }
    for fragment, (dim, (start, length)) in splits.items():
        if fragment in name:
            return dim, start, length
    return None


def read_shard(tensors: Any, name: str, config: ModelConfig, shape: RankShape) -> torch.Tensor:
    """This rank's part of `name` from an open safetensors file (`safe_open(...)`)."""
    split = split_of(name, config, shape)
    if split is None:
        return cast(torch.Tensor, tensors.get_tensor(name))
    dim, start, length = split
    lazy = tensors.get_slice(name)
    size = lazy.get_shape()[dim]
    if start + length > size:
        raise ValueError(
            f"checkpoint tensor {name!r} has {size} entries along dimension {dim}; tensor-parallel "
            f"rank {shape.rank} of {shape.size} needs {start}..{start + length} (check config.json)"
        )
    if dim == _ROWS:
        return cast(torch.Tensor, lazy[start : start + length])
    return cast(torch.Tensor, lazy[:, start : start + length])
