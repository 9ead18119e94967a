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
import torch.nn.functional as F
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
    cos: torch.Tensor  # [tokens, 1, rotary dimensions / 2]
    sin: torch.Tensor
    lora: LoraStep | None = None  # rows that run with LoRA adapters (engine/model/lora/weights.py)
    # The sliding layers' cos and sin where their rope base differs (Gemma 3); None: cos, sin.
    local_rotary: tuple[torch.Tensor, torch.Tensor] | None = None


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: KernelBackend) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Grouped-query attention over the paged KV cache with RoPE, and the variants the families
    need: q/k biases, q/k norms per head or over all heads, partial rotary, a sliding window,
    soft-capped scores, a scale of the family's own."""

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
        self.rotary_dim = config.rotary_size
        self.scale = config.attention_scale or config.head_dim**-0.5
        window = config.window_of(layer)
        self.variant = (window, config.attn_logit_softcapping)  # paged_attention's last two
        self.local_rope = config.local_rope_theta is not None and window is not None
        self.eps = config.rms_norm_eps
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qk_size = q_size + kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.qkv_bias)
        self.o_proj = RowParallelLinear(
            q_size, config.hidden_size, config.o_bias, group, ops.linear
        )
        norm_sizes = (self.head_dim, self.head_dim) if config.qk_norm else None
        if config.qk_norm_whole:
            norm_sizes = (q_size, kv_size)
        self.q_norm = RMSNorm(norm_sizes[0], self.eps, ops) if norm_sizes else None
        self.k_norm = RMSNorm(norm_sizes[1], self.eps, ops) if norm_sizes else None
        self.norms_whole = config.qk_norm_whole
        # q_norm and k_norm weights stacked per head, so both norms run as one call.
        self.qk_norm_weight: torch.Tensor | None = None
        self.qkv_linear = ops.linear  # prepared for the loaded weight by fuse_weights

    def fuse_weights(self, prepared: PreparedLinears) -> None:
        """Build derived tensors once the checkpoint's weights are in place."""
        self.qkv_linear = prepared(self.qkv_proj, self.qkv_linear)
        self.o_proj.linear = prepared(self.o_proj, self.o_proj.linear)
        if self.q_norm is not None and self.k_norm is not None and not self.norms_whole:
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
        if self.norms_whole:
            qkv = self._norm_whole(qkv)
        qk = qkv[:, : self.qk_size].view(num_tokens, -1, self.head_dim)
        v = qkv[:, self.qk_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm_weight is not None:
            qk = self.ops.rms_norm_per_head(qk, self.qk_norm_weight, self.eps)
        qk = self._rotate(qk, step)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        cache, layer, meta = step.kv_cache, self.layer, step.attention
        out = self.ops.paged_attention(q, k, v, cache, layer, meta, self.scale, *self.variant)
        projected = cast(torch.Tensor, self.o_proj(out))
        if step.lora is not None:
            step.lora.add(projected, out.reshape(num_tokens, -1), self.layer, "o")
        return projected

    def _rotate(self, qk: torch.Tensor, step: StepContext) -> torch.Tensor:
        cos, sin = (
            step.local_rotary if self.local_rope and step.local_rotary else (step.cos, step.sin)
        )
        if self.rotary_dim == self.head_dim:
            return self.ops.apply_rotary(qk, cos, sin)
        rotated = self.ops.apply_rotary(qk[..., : self.rotary_dim], cos, sin)
        return torch.cat((rotated, qk[..., self.rotary_dim :]), dim=-1)

    def _norm_whole(self, qkv: torch.Tensor) -> torch.Tensor:
        """q and k each normed over all their heads at once (OLMoE)."""
        assert self.q_norm is not None and self.k_norm is not None
        q_size = self.num_heads * self.head_dim
        q = self.q_norm(qkv[:, :q_size])
        k = self.k_norm(qkv[:, q_size : self.qk_size])
        return torch.cat((q, k, qkv[:, self.qk_size :]), dim=-1)


class GatedMLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or tanh-approximated
    GELU (GeGLU, Gemma)."""

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
        self.act_and_mul = ops.silu_and_mul if config.hidden_act == "silu" else gelu_tanh_and_mul

    def fuse_weights(self, prepared: PreparedLinears) -> None:
        self.gate_up_linear = prepared(self.gate_up_proj, self.gate_up_linear)
        self.down_proj.linear = prepared(self.down_proj, self.down_proj.linear)

    def forward(self, x: torch.Tensor, lora: LoraStep | None = None) -> torch.Tensor:
        gate_up = self.gate_up_linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
        if lora is not None:
            lora.add(gate_up, x, self.layer, "gate_up")
        activated = self.act_and_mul(gate_up)
        down = cast(torch.Tensor, self.down_proj(activated))
        if lora is not None:
            lora.add(down, activated, self.layer, "down")
        return down


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU: gelu_tanh(gate) * up, where gate_up holds [gate | up] along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
