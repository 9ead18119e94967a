"""The layers every decoder family shares: RMSNorm, grouped-query attention over the paged KV
cache with RoPE, and the gated MLP, plus the per-step context they read.

Projections that read the same input are fused (q|k|v, gate|up) so each layer runs two matmuls
fewer; the loader fills the fused weights from the checkpoint's separate tensors. Tokens of all
sequences in a step are one flat batch [tokens, hidden]; attention learns how they group from
the step's `AttentionMetadata`.

Under tensor parallelism (engine/model/parallel) each rank builds its layers with its slice of
the sizes (`RankShape`): its query and KV heads, its MLP columns. o_proj and down_proj sum their
partial outputs over the ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import cast

import torch
from torch import nn

from engine.kernels.attention_metadata import AttentionMetadata
from engine.kernels.backend import KernelBackend, Linear
from engine.kernels.kv_cache import PagedKVCache
from engine.model.config import ModelConfig
from engine.model.lora.weights import LoraStep
from engine.model.parallel.group import TensorParallelGroup
from engine.model.parallel.layers import RowParallelLinear
from engine.model.parallel.layout import RankShape

# (a linear module, its current linear function) -> the function to run it with
PreparedLinears = Callable[[nn.Linear, Linear], Linear]


@dataclasses.dataclass
class StepContext:
    """What every layer needs for one step, computed once per step."""

    attention: AttentionMetadata
    kv_cache: PagedKVCache
    cos: torch.Tensor  # [tokens, 1, head_dim / 2]
    sin: torch.Tensor
    lora: LoraStep | None = None  # rows that run with LoRA adapters (engine/model/lora/weights.py)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        ops: KernelBackend,
        shape: RankShape,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.ops = ops
        self.num_heads, self.num_kv_heads = shape.num_heads, shape.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.eps = config.rms_norm_eps
        qk_size = (self.num_heads + self.num_kv_heads) * self.head_dim
        self.qk_size = qk_size
        self.qkv_proj = nn.Linear(
            config.hidden_size, qk_size + self.num_kv_heads * self.head_dim, bias=config.qkv_bias
        )
        self.o_proj = RowParallelLinear(
            self.num_heads * self.head_dim, config.hidden_size, config.o_bias, group, ops.linear
        )
        self.q_norm = RMSNorm(self.head_dim, self.eps, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, self.eps, ops) if config.qk_norm else None
        # q_norm and k_norm weights stacked per head, so both norms run as one call.
        self.qk_norm_weight: torch.Tensor | None = None
        self.qkv_linear = ops.linear  # prepared for the loaded weight by fuse_weights

    def fuse_weights(self, prepared: PreparedLinears) -> None:
        """Build derived tensors once the checkpoint's weights are in place."""
        self.qkv_linear = prepared(self.qkv_proj, self.qkv_linear)
        self.o_proj.linear = prepared(self.o_proj, self.o_proj.linear)
        if self.q_norm is not None and self.k_norm is not None:
            self.qk_norm_weight = torch.cat(
                (
                    self.q_norm.weight.detach().expand(self.num_heads, -1),
                    self.k_norm.weight.detach().expand(self.num_kv_heads, -1),
                )
            )

    def forward(self, x: torch.Tensor, step: StepContext) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_linear(x, self.qkv_proj.weight, self.qkv_proj.bias)
        if step.lora is not None:
            step.lora.add(qkv, x, self.layer, "qkv")
        qk = qkv[:, : self.qk_size].view(num_tokens, -1, self.head_dim)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm_weight is not None:
            qk = self.ops.rms_norm_per_head(qk, self.qk_norm_weight, self.eps)
        qk = self.ops.apply_rotary(qk, step.cos, step.sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.ops.paged_attention(
            q, k, v, step.kv_cache, self.layer, step.attention, self.scale
        )
        projected = cast(torch.Tensor, self.o_proj(out))
        if step.lora is not None:
            step.lora.add(projected, out.reshape(num_tokens, -1), self.layer, "o")
        return projected


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        ops: KernelBackend,
        shape: RankShape,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.ops = ops
        size, hidden = shape.intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Linear(hidden, 2 * size, bias=config.mlp_bias)
        self.down_proj = RowParallelLinear(size, hidden, config.mlp_bias, group, ops.linear)
        self.gate_up_linear = ops.linear  # prepared for the loaded weight by fuse_weights

    def fuse_weights(self, prepared: PreparedLinears) -> None:
        self.gate_up_linear = prepared(self.gate_up_proj, self.gate_up_linear)
        self.down_proj.linear = prepared(self.down_proj, self.down_proj.linear)

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        gate_up = self.gate_up_linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        if lora is not None:
            lora.add(gate_up, x, self.layer, "gate_up")
        activated = self.ops.silu_and_mul(gate_up)
        down = cast(torch.Tensor, self.down_proj(activated))
        if lora is not None:
            lora.add(down, activated, self.layer, "down")
        return down
