"""A mixture-of-experts MLP (Qwen3-MoE, OLMoE, Mixtral): a router picks each token's top-k of
E SwiGLU experts and its output is their outputs weighed by the routing weights.

    probs = softmax(router(x))                # over the E experts, in float32
    w, e = top_k(probs)                       # normalised to sum to 1 where the family says
    y = sum over k of w_k * down_e(silu(gate_e(x)) * up_e(x))

Only the experts some token of the step picked run, each once for all the tokens routed to it
(one matmul pair over those rows), in expert order, as transformers adds them up. The experts'
weights are two stacked parameters, gate|up [E * 2I, hidden] and down [E * hidden, I], which
the loader fills expert by expert at row offsets (engine/model/loading/weight_names.py). Served
quantized (a GGUF file's stacked block types kept, or quantized at load), each is one packed
weight whose rows are cut into the experts' weights where they lie (`expert_weights`): an
expert's rows are whole panels of the packed layout, so no byte is copied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.kernels.backend import KernelBackend, Linear
from engine.model.config import ModelConfig
from engine.model.quantized import layers as quantized_layers

if TYPE_CHECKING:
    from engine.kernels.cpu.quantized import PackedWeight


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, ops: KernelBackend) -> None:
        super().__init__()
        self.ops = ops
        self.num_experts = config.num_experts
        self.top_k = config.experts_per_token
        self.normalize = config.normalize_expert_weights
        self.size, hidden = config.expert_intermediate_size, config.hidden_size
        self.gate = nn.Linear(hidden, self.num_experts, bias=False)  # the router
        self.experts = Experts(self.num_experts, hidden, self.size)
        # Each expert's gate|up and down matmuls when served quantized (use_packed).
        self.packed: list[tuple[Linear, Linear]] | None = None
        # Experts run (each reads its weights once) and steps taken: the bytes a step reads,
        # for the benchmarks (engine/bench/raw_model.py).
        self.experts_run = 0
        self.steps = 0

    def use_packed(self, gate_up: PackedWeight | None, down: PackedWeight | None) -> None:
        """Run the experts on their packed weights (the loader's, by parameter name)."""
        if gate_up is None or down is None:
            return
        gate_ups = expert_weights(gate_up, self.num_experts)
        downs = expert_weights(down, self.num_experts)
        self.packed = [
            (quantized_layers.linear(a), quantized_layers.linear(b))
            for a, b in zip(gate_ups, downs, strict=True)
        ]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [tokens, k] and their weights [tokens, k] (x's dtype)."""
        logits = self.ops.linear(x, self.gate.weight, None)
        weights, experts = torch.softmax(logits, dim=-1, dtype=torch.float32).topk(self.top_k)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = self.route(x)
        flat = experts.flatten()
        picks = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        matmuls = self._matmuls()
        self.steps += 1
        self.experts_run += self.num_experts - counts.count(0)
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = picks[start : start + count]
            start += count
            tokens = pairs // self.top_k
            (gate_up, up_linear), (down, down_linear) = matmuls(expert)
            hidden = self.ops.silu_and_mul(up_linear(x[tokens], gate_up, None))
            routed = down_linear(hidden, down, None)
            out.index_add_(0, tokens, routed * weights.view(-1)[pairs, None])
        return out

    def _matmuls(self) -> Callable[[int], tuple[tuple[torch.Tensor, Linear], ...]]:
        """expert -> ((gate|up weight, its linear), (down weight, its linear))."""
        if self.packed is not None:
            packed, placeholder = self.packed, self.experts.gate_up
            return lambda e: ((placeholder, packed[e][0]), (placeholder, packed[e][1]))
        gate_up, down = self.experts.stacked()
        linear = self.ops.linear
        return lambda e: ((gate_up[e], linear), (down[e], linear))


def expert_weights(weight: PackedWeight, experts: int) -> list[PackedWeight]:
    """A stacked packed weight [experts * rows, k] as each expert's [rows, k] (views of its
    parts' bytes: every boundary falls on a panel of the packed layout)."""
    from engine.kernels.cpu.quantized import PackedPart, stacked
    from engine.quantization.layout import PANEL, packed_bytes

    rows = weight.rows // experts
    pieces: list[list[PackedPart]] = [[] for _ in range(experts)]
    first = 0
    for part in weight.parts:
        for start in range(first, first + part.rows, rows):  # parts hold whole experts
            stop = min(start + rows, first + part.rows)
            if (start - first) % PANEL or ((stop - first) % PANEL and stop != first + part.rows):
                raise ValueError(f"expert rows {start}..{stop} are not whole panels")
            offset = packed_bytes(start - first, part.k, part.format)
            size = packed_bytes(stop - start, part.k, part.format)
            data = part.data[offset : offset + size]
            piece = PackedPart(part.format, stop - start, part.k, data, part.source)
            pieces[start // rows].append(piece)
        first += part.rows
    return [stacked(expert) for expert in pieces]


class Experts(nn.Module):
    """The E experts' weights, stacked: gate_up [E * 2I, hidden] (each expert's gate rows, then
    its up rows) and down [E * hidden, I]."""

    def __init__(self, num_experts: int, hidden: int, size: int) -> None:
        super().__init__()
        self.shape = (num_experts, hidden, size)
        self.gate_up = nn.Parameter(torch.empty(num_experts * 2 * size, hidden))
        self.down = nn.Parameter(torch.empty(num_experts * hidden, size))

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up [E, 2I, hidden] and down [E, hidden, I] (views)."""
        num_experts, hidden, size = self.shape
        return (
            self.gate_up.view(num_experts, 2 * size, hidden),
            self.down.view(num_experts, hidden, size),
        )
