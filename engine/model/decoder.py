"""The decoder-only transformer shared by Llama, Qwen2 and Qwen3.

    h = embed(tokens)
    for each layer:
        h = h + Attention(RMSNorm(h))   # GQA, RoPE; Qwen2: q/k/v bias; Qwen3: q/k head norms
        h = h + SwiGLU-MLP(RMSNorm(h))
    logits = lm_head(RMSNorm(h))        # lm_head may share the embedding matrix

The architectures differ only in `ModelConfig` flags. Projections that read the same input are
fused (q|k|v, gate|up) so each layer runs two matmuls fewer; the loader fills the fused weights
from the checkpoint's separate tensors. Tokens of all sequences in a step are one flat batch
[tokens, hidden]; attention learns how they group from the step's `AttentionMetadata`.

Under tensor parallelism (engine/model/parallel) each rank builds the same module tree with its
slice of the sizes (`RankShape`): its query and KV heads, its MLP columns, its vocabulary rows.
Hidden states stay whole on every rank; o_proj and down_proj sum their partial outputs over the
ranks, the embedding sums its row lookups, and the logits are gathered on rank 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, cast

import torch
from torch import nn

from engine.kernels.attention_metadata import AttentionMetadata
from engine.kernels.backend import KernelBackend, Linear
from engine.kernels.kv_cache import PagedKVCache
from engine.model import quantized_weights
from engine.model.config import ModelConfig
from engine.model.fused_decode import FusedDecode
from engine.model.lora_weights import LoraStep
from engine.model.parallel.group import TensorParallelGroup
from engine.model.parallel.layers import RowParallelLinear, VocabParallelEmbedding
from engine.model.parallel.layout import RankShape, rank_shape
from engine.model.quantized_formats import WeightFormat
from engine.model.rope import rope_inv_freq
from engine.packed_weights import packs_decoder

if TYPE_CHECKING:
    from engine.kernels.cpu.quantized import PackedWeight


# (a linear module, its current linear function) -> the function to run it with
PreparedLinears = Callable[[nn.Linear, Linear], Linear]


@dataclasses.dataclass
class StepContext:
    """What every layer needs for one step, computed once per step."""

    attention: AttentionMetadata
    kv_cache: PagedKVCache
    cos: torch.Tensor  # [tokens, 1, head_dim / 2]
    sin: torch.Tensor
    lora: LoraStep | None = None  # rows that run with LoRA adapters (engine/model/lora_weights.py)


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


class DecoderLayer(nn.Module):
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

    def forward(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), step)
        return cast(torch.Tensor, h + self.mlp(self.post_attention_layernorm(h), step.lora))


class DecoderForCausalLM(nn.Module):
    def __init__(
        self, config: ModelConfig, ops: KernelBackend, group: TensorParallelGroup | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.ops = ops
        self.group = group or TensorParallelGroup()
        self.shape = shape = rank_shape(config, self.group.rank, self.group.size)
        self.embed_tokens = VocabParallelEmbedding(
            shape.vocab_per_rank, config.hidden_size, shape.vocab_start, self.group
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, layer, ops, shape, self.group)
            for layer in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else nn.Linear(config.hidden_size, shape.vocab_per_rank, bias=False)
        )
        # On the CPU even while the loader builds the model on the meta device: arithmetic on
        # meta tensors runs through torch._refs, whose first use imports torch._dynamo (a large
        # import that every worker start and restart would pay). fuse_weights() moves it to the
        # model's device.
        with torch.device("cpu"):
            self.inv_freq: torch.Tensor = rope_inv_freq(config)
        self.project_to_vocab: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Parameters served quantized (set by the loader: engine/model/quantized_formats.py).
        self.weight_formats: dict[str, WeightFormat] = {}
        self.fused_decode: FusedDecode | None = None  # all layers of a decode step in C++

    def fuse_weights(self, quantized: Mapping[str, PackedWeight] | None = None) -> None:
        """Prepare every matmul once the checkpoint's weights are in place. `quantized`: the
        weights the loader packed quantized, by parameter name (their float parameters are
        empty placeholders)."""
        quantized = quantized or {}
        names = {module: name for name, module in self.named_modules()}
        # The decoder's float matmuls are prepared (packed, on the CPU) only while the copies
        # stay small: the rule the memory plan counts them by (engine/packed_weights.py).
        matmuls = (m.weight for m in self.layers.modules() if isinstance(m, nn.Linear))
        prepare = packs_decoder(sum(w.numel() * w.element_size() for w in matmuls))

        def prepared(module: nn.Linear, current: Linear) -> Linear:
            packed = quantized.get(f"{names[module]}.weight")
            if packed is not None:
                return quantized_weights.linear(packed)
            return self.ops.prepared_linear(module.weight) if prepare else current

        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.fuse_weights(prepared)
            layer.mlp.fuse_weights(prepared)
        self.inv_freq = rope_inv_freq(self.config).to(self.embed_tokens.weight.device)
        self.embed_tokens.quantized = quantized.get("embed_tokens.weight")
        self.fused_decode = FusedDecode.for_model(self, dict(quantized))
        head = "embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        if head in quantized:
            self.project_to_vocab = quantized_weights.output_projection(quantized[head])
            return
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.project_to_vocab = self.ops.output_projection(weight)

    def forward(
        self,
        token_ids: torch.Tensor,
        attention: AttentionMetadata,
        kv_cache: PagedKVCache,
        lora: LoraStep | None = None,
    ) -> torch.Tensor:
        """Hidden states [tokens, hidden] after the last layer (before the final norm); the
        rows `lora` names run with their adapters."""
        h = self.embed_tokens(token_ids)
        cos, sin = self.ops.rotary_cos_sin(attention.positions, self.inv_freq, h.dtype)
        fused = self.fused_decode
        if lora is None and fused is not None and fused.takes(h, attention):
            return fused.run(h, attention, kv_cache, cos, sin)
        step = StepContext(attention, kv_cache, cos, sin, lora)
        for layer in self.layers:
            h = layer(h, step)
        return cast(torch.Tensor, h)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab] of the given last-layer hidden rows, on rank 0 (None on
        the other ranks of a tensor-parallel group)."""
        assert self.project_to_vocab is not None, "fuse_weights() runs after loading"
        logits = self.group.gather_columns(self.project_to_vocab(self.norm(hidden)))
        if logits is None:
            return None
        if logits.shape[-1] != self.config.vocab_size:  # the last shard's padding rows
            logits = logits[:, : self.config.vocab_size]
        return logits.float()
