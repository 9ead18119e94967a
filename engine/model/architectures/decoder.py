"""The skeleton every decoder family fills: token embedding, the family's layers, a final
RMSNorm and the vocabulary projection (which may share the embedding matrix).

A family subclasses `CausalLM` and says how to build one layer (`make_layer`); each layer
prepares its matmuls in `fuse_weights` once the loader has filled its parameters. Under tensor
parallelism (engine/model/parallel) each rank builds the same module tree with its slice of the
sizes (`RankShape`); hidden states stay whole on every rank, the embedding sums its row lookups
and the logits are gathered on rank 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol, cast

import torch
from torch import nn

from engine.kernels.attention_metadata import AttentionMetadata
from engine.kernels.backend import KernelBackend, Linear
from engine.kernels.kv_cache import PagedKVCache
from engine.kernels.packed_weights import packs_decoder
from engine.model.architectures.experts import SparseMoE
from engine.model.architectures.fused_decode import FusedDecode, unfused_reason
from engine.model.architectures.layers import PreparedLinears, RMSNorm, StepContext
from engine.model.architectures.rope import rope_inv_freq, rotary_scale
from engine.model.config import ModelConfig
from engine.model.lora.weights import LoraStep
from engine.model.parallel.group import TensorParallelGroup
from engine.model.parallel.layers import VocabParallelEmbedding
from engine.model.parallel.layout import RankShape, rank_shape
from engine.model.quantized import layers as quantized_layers
from engine.model.quantized.formats import WeightFormat

if TYPE_CHECKING:
    from engine.kernels.cpu.quantized import PackedWeight


class DecoderLayer(Protocol):
    def fuse_weights(self, prepared: PreparedLinears) -> None: ...

    def __call__(self, h: torch.Tensor, step: StepContext) -> torch.Tensor: ...


class CausalLM(nn.Module):
    """A decoder-only language model; subclasses build their family's layers."""

    # Whether engine/kernels/cpu/decode_step.cpp implements this family's layers (for configs
    # that fused_decode.unfused_reason accepts).
    runs_fused_decode = False

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
            self.make_layer(config, layer, ops, shape, self.group)
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
            self.local_inv_freq: torch.Tensor | None = (
                None if config.local_rope_theta is None else rope_inv_freq(config, local=True)
            )
        self.rotary_scale = rotary_scale(config)
        self.project_to_vocab: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Parameters served quantized (set by the loader: engine/model/quantized/formats.py).
        self.weight_formats: dict[str, WeightFormat] = {}
        self.fused_decode: FusedDecode | None = None  # all layers of a decode step in C++

    def make_layer(
        self,
        config: ModelConfig,
        layer: int,
        ops: KernelBackend,
        shape: RankShape,
        group: TensorParallelGroup,
    ) -> nn.Module:
        raise NotImplementedError

    def fuse_weights(self, quantized: Mapping[str, PackedWeight] | None = None) -> None:
        """Prepare every matmul once the checkpoint's weights are in place. `quantized`: the
        weights the loader packed quantized, by parameter name (their float parameters are
        empty placeholders)."""
        quantized = quantized or {}
        names = {module: name for name, module in self.named_modules()}
        # The decoder's float matmuls are prepared (packed, on the CPU) only while the copies
        # stay small: the rule the memory plan counts them by (engine/kernels/packed_weights.py).
        matmuls = (m.weight for m in self.layers.modules() if isinstance(m, nn.Linear))
        prepare = packs_decoder(sum(w.numel() * w.element_size() for w in matmuls))

        def prepared(module: nn.Linear, current: Linear) -> Linear:
            packed = quantized.get(f"{names[module]}.weight")
            if packed is not None:
                return quantized_layers.linear(packed)
            return self.ops.prepared_linear(module.weight) if prepare else current

        for layer in self.layers:
            cast(DecoderLayer, layer).fuse_weights(prepared)
        for name, module in self.named_modules():
            if isinstance(module, SparseMoE):
                gate_up, down = (quantized.get(f"{name}.experts.{p}") for p in ("gate_up", "down"))
                module.use_packed(gate_up, down)
        device = self.embed_tokens.weight.device
        self.inv_freq = rope_inv_freq(self.config).to(device)
        if self.local_inv_freq is not None:
            self.local_inv_freq = rope_inv_freq(self.config, local=True).to(device)
        self.embed_tokens.quantized = quantized.get("embed_tokens.weight")
        if self.runs_fused_decode and unfused_reason(self.config) is None:
            self.fused_decode = FusedDecode.for_model(self, dict(quantized))
        head = "embed_tokens.weight" if self.lm_head is None else "lm_head.weight"
        if head in quantized:
            self.project_to_vocab = quantized_layers.output_projection(quantized[head])
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
        if self.config.scaled_embeddings:  # by sqrt(hidden) rounded to the model's dtype
            h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype)
        cos, sin = self._rotary(attention.positions, self.inv_freq, h.dtype)
        fused = self.fused_decode
        if lora is None and fused is not None and fused.takes(h, attention):
            return fused.run(h, attention, kv_cache, cos, sin)
        step = StepContext(attention, kv_cache, cos, sin, lora)
        if self.local_inv_freq is not None:
            step.local_rotary = self._rotary(attention.positions, self.local_inv_freq, h.dtype)
        for layer in self.layers:
            h = layer(h, step)
        return cast(torch.Tensor, h)

    def layer_path(self) -> str:
        """How the layers run, in words, for the start log."""
        family = f"{self.config.architecture} ({type(self).__name__})"
        if self.fused_decode is not None:
            return (
                f"{family}: decode steps of up to {self.fused_decode.max_tokens} tokens in one "
                "C++ call (engine/kernels/cpu/decode_step.cpp), other steps layer by layer"
            )
        why = unfused_reason(self.config) if self.runs_fused_decode else None
        if not self.runs_fused_decode:
            why = "the fused decode step does not implement this family's layers"
        elif why is None:
            why = (
                "the fused decode step needs the compiled CPU kernels, one rank, and float32 "
                "(or bfloat16 weights, all packed for bf16_linear.cpp)"
            )
        return f"{family}: layer by layer ({why})"

    def _rotary(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.ops.rotary_cos_sin(positions, inv_freq, dtype)
        if self.rotary_scale != 1.0:
            return cos * self.rotary_scale, sin * self.rotary_scale
        return cos, sin

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """float32 logits [rows, vocab] of the given last-layer hidden rows, on rank 0 (None on
        the other ranks of a tensor-parallel group)."""
        assert self.project_to_vocab is not None, "fuse_weights() runs after loading"
        logits = self.group.gather_columns(self.project_to_vocab(self.norm(hidden)))
        if logits is None:
            return None
        if logits.shape[-1] != self.config.vocab_size:  # the last shard's padding rows
            logits = logits[:, : self.config.vocab_size]
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
