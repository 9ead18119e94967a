"""Checkpoint tensor names onto a family's parameters: q/k/v into the fused qkv_proj, gate/up
into gate_up_proj (Phi-3 stores both fused already), each expert's gate/up/down into the stacked
expert parameters, at this rank's row offsets (torch-free: the root uses it to plan the memory
of quantized weights)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from engine.model.config import ModelConfig
from engine.model.parallel.layout import RankShape, rank_shape

# An expert's matrix: Qwen3-MoE's and OLMoE's mlp.experts.E.{gate,up,down}_proj, Mixtral's
# block_sparse_moe.experts.E.{w1,w3,w2}.
_EXPERT = re.compile(
    r"^(layers\.\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
    r"(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
_EXPERT_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


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
    expert = _EXPERT.match(name)
    if expert is not None:
        return _expert_rows(config, expert.group(1), int(expert.group(2)), expert.group(3))
    name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # Mixtral's router
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


def _expert_rows(config: ModelConfig, layer: str, expert: int, part: str) -> tuple[str, int]:
    size, hidden = config.expert_intermediate_size, config.hidden_size
    kind = _EXPERT_PART[part]
    if kind == 2:
        return f"{layer}.mlp.experts.down", expert * hidden
    return f"{layer}.mlp.experts.gate_up", expert * 2 * size + kind * size


def parts_of(param: str, config: ModelConfig) -> int:
    """How many checkpoint tensors fill a parameter (the loader packs a quantized one when it
    has them all)."""
    if param.endswith(".experts.gate_up"):
        return 2 * config.num_experts
    if param.endswith(".experts.down"):
        return config.num_experts
    if config.fused_checkpoint:
        return 1
    return 3 if ".qkv_proj." in param else 2 if ".gate_up_proj." in param else 1


def expected_weight_keys(
    params: Iterable[str], config: ModelConfig, shape: RankShape | None = None
) -> list[str]:
    """Every `param@row_start` piece the checkpoint has to provide."""
    shape = shape or rank_shape(config, 0, 1)
    q_rows = shape.num_heads * config.head_dim
    kv_rows = shape.num_kv_heads * config.head_dim
    experts, size = range(config.num_experts), config.expert_intermediate_size
    keys = []
    for name in params:
        if name.endswith(".experts.gate_up"):
            keys += [f"{name}@{e * 2 * size + k * size}" for e in experts for k in (0, 1)]
        elif name.endswith(".experts.down"):
            keys += [f"{name}@{e * config.hidden_size}" for e in experts]
        elif config.fused_checkpoint:
            keys.append(f"{name}@0")
        elif ".qkv_proj." in name:
            keys += [f"{name}@0", f"{name}@{q_rows}", f"{name}@{q_rows + kv_rows}"]
        elif ".gate_up_proj." in name:
            keys += [f"{name}@0", f"{name}@{shape.intermediate_size}"]
        else:
            keys.append(f"{name}@0")
    return keys


def matrix_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(rows, columns) of every matmul and embedding parameter of a whole (one-rank) model that
    may be served quantized (a MoE layer's stacked experts among them, its router not); the
    vocabulary projection reads `embed_tokens.weight` when the embeddings are tied."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_out, kv_out = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    attention = {
        "self_attn.qkv_proj.weight": (q_out + 2 * kv_out, hidden),
        "self_attn.o_proj.weight": (hidden, q_out),
    }
    mlp = {
        "mlp.gate_up_proj.weight": (2 * inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    experts, size = config.num_experts, config.expert_intermediate_size
    moe = {
        "mlp.experts.gate_up": (experts * 2 * size, hidden),
        "mlp.experts.down": (experts * hidden, size),
    }
    shapes = {}
    for layer in range(config.num_layers):
        parts = {**attention, **(moe if config.is_moe_layer(layer) else mlp)}
        shapes.update({f"layers.{layer}.{part}": shape for part, shape in parts.items()})
    shapes["embed_tokens.weight"] = (config.vocab_size, hidden)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes
