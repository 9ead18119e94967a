"""The llama family: pre-norm residual layers over the shared attention and SwiGLU MLP.

    h = embed(tokens)
    for each layer:
        h = h + Attention(RMSNorm(h))   # GQA, RoPE
        h = h + SwiGLU-MLP(RMSNorm(h))
    logits = lm_head(RMSNorm(h))        # lm_head may share the embedding matrix

Llama, Mistral and Ministral (sliding-window layers), Qwen2 (q/k/v biases), Qwen3 (q/k head
norms) and Phi-3 (q|k|v and gate|up stored fused, partial rotary, longrope) differ only in the
config their registry entries read (engine/model/architectures/registry.py).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.kernels.backend import KernelBackend
from engine.model.architectures.decoder import CausalLM
from engine.model.architectures.layers import (
    Attention,
    GatedMLP,
    PreparedLinears,
    RMSNorm,
    StepContext,
)
from engine.model.config import ModelConfig
from engine.model.parallel.group import TensorParallelGroup
from engine.model.parallel.layout import RankShape


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        ops: KernelBackend,
        shape: RankShape,
        group: TensorParallelGroup,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, layer, ops, shape, group)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp = GatedMLP(config, layer, ops, shape, group)

    def fuse_weights(self, prepared: PreparedLinears) -> None:
        self.self_attn.fuse_weights(prepared)
        self.mlp.fuse_weights(prepared)

    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), step)
        return cast(torch.Tensor, h + self.mlp(self.post_attention_layernorm(h), step.lora))


class LlamaForCausalLM(CausalLM):
    runs_fused_decode = True

    def make_layer(
        self,
        config: ModelConfig,
        layer: int,
        ops: KernelBackend,
        shape: RankShape,
        group: TensorParallelGroup,
    ) -> nn.Module:
        return LlamaDecoderLayer(config, layer, ops, shape, group)
