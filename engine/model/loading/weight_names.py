"""Checkpoint tensor names onto the decoder's parameters: q/k/v into the fused qkv_proj, gate/up
into gate_up_proj, at this rank's row offsets (torch-free: the root uses it to plan the memory of
quantized weights)."""

from __future__ import annotations

from collections.abc import Iterable

from engine.model.config import ModelConfig
from engine.model.parallel.layout import RankShape, rank_shape


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
    params: Iterable[str], config: ModelConfig, shape: RankShape | None = None
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


def matrix_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(rows, columns) of every matmul and embedding parameter of a whole (one-rank) model; the
    vocabulary projection reads `embed_tokens.weight` when the embeddings are tied."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = {
        "self_attn.qkv_proj.weight": (q_out + 2 * kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
        "mlp.gate_up_proj.weight": (2 * inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    shapes = {
        f"layers.{layer}.{part}": shape
        for layer in range(config.num_layers)
        for part, shape in per_layer.items()
    }
    shapes["embed_tokens.weight"] = (config.vocab_size, hidden)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes
