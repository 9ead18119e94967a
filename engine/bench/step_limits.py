"""What a forward step cannot beat on this machine: the bytes it must read over the measured
memory bandwidth, and its FLOPs over the measured matmul rate (roofline, per step).

Both rates are measured in the calling process at its torch thread count, so a benchmark's
figures and its limits share the same machine state.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import torch

from engine.model.loading.weight_names import matrix_shapes
from engine.model.placement.capacity import kv_block_bytes
from engine.model.runner import ModelRunner

COPY_BYTES = 256 << 20  # large enough to stream through every cache level
MATMUL_SIZE = 1024


@dataclasses.dataclass(frozen=True)
class MachineRates:
    bytes_per_second: float  # a torch copy of a large buffer, read + write
    flops_per_second: float  # a square matmul in the model's dtype

    @classmethod
    def measure(
        cls, dtype: torch.dtype, device: torch.device | None = None, repeats: int = 5
    ) -> MachineRates:
        device = device or torch.device("cpu")
        source = torch.ones(COPY_BYTES // 4, device=device)
        target = torch.empty_like(source)
        copy_seconds = _median_seconds(lambda: target.copy_(source), repeats, device)
        # A GPU needs a larger square to reach its matmul rate than a CPU does.
        size = MATMUL_SIZE * (8 if device.type == "cuda" else 1)
        a = torch.randn(size, size, device=device).to(dtype)
        matmul_seconds = _median_seconds(lambda: a @ a, repeats, device)
        return cls(2 * COPY_BYTES / copy_seconds, 2 * size**3 / matmul_seconds)

    def describe(self) -> str:
        return (
            f"memory bandwidth {self.bytes_per_second / 1e9:.1f} GB/s (torch copy), "
            f"matmul {self.flops_per_second / 1e9:.1f} GFLOP/s"
        )


@dataclasses.dataclass(frozen=True)
class StepCost:
    bytes_read: float  # weights + the KV the step's attention reads
    flops: float

    def limit_seconds(self, rates: MachineRates) -> float:
        """The roofline: the slower of streaming the bytes and doing the FLOPs."""
        return max(self.bytes_read / rates.bytes_per_second, self.flops / rates.flops_per_second)


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """Per-step arithmetic of one model: weights read by matmuls, KV and attention per token.

    A mixture of experts reads only the experts its tokens pick: with k of E picked per token,
    uniformly, a step of b tokens reads E * (1 - (1 - k/E)^b) experts of each layer (k at b = 1,
    all E as b grows), and each token runs k experts' FLOPs."""

    weight_bytes: int  # every matmul weight but the experts' (the embedding only as LM head)
    layer_params: int  # matmul weights applied to every token (experts: k of E of them)
    head_params: int  # the LM head's, applied to the one sampled token of each sequence
    kv_bytes_per_token: int  # K and V of one token, all layers
    attention_flops_per_key: int  # one query token against one key, all layers and heads
    expert_bytes: int = 0  # every expert of every MoE layer
    experts: tuple[int, int] = (0, 0)  # (E, k): experts per layer, picked per token

    @classmethod
    def of(cls, runner: ModelRunner) -> ModelCost:
        """A weight served quantized counts its packed codes (engine/quantization/layout.py)."""
        model, config = runner.model, runner.config
        head_name = "embed_tokens.weight" if model.lm_head is None else "lm_head.weight"
        params = dict(model.named_parameters())
        read = {}
        numel = {}
        for name, (rows, columns) in matrix_shapes(config).items():
            if name == "embed_tokens.weight" and name != head_name:
                continue  # a lookup, not a matmul
            quantized = model.weight_formats.get(name)
            numel[name] = rows * columns // runner.group.size
            read[name] = (
                quantized.packed_bytes(columns)
                if quantized is not None
                else numel[name] * params[name].element_size()
            )
        per_token = (
            kv_block_bytes(config, runner.block_size, runner.kv_cache_dtype) // runner.block_size
        )
        heads = runner.shape.num_heads
        experts = [name for name in numel if ".mlp.experts." in name]
        share = config.experts_per_token / config.num_experts if experts else 0.0
        dense = [name for name in numel if name not in experts]
        return cls(
            sum(read[name] for name in dense),
            sum(numel[name] for name in dense if name != head_name)
            + round(share * sum(numel[name] for name in experts)),
            numel[head_name],
            per_token,
            4 * heads * config.head_dim * config.num_layers,  # q.k and p.v: 2 FLOPs each
            sum(read[name] for name in experts),
            (config.num_experts, config.experts_per_token) if experts else (0, 0),
        )

    def expert_share(self, tokens: int) -> float:
        """The expected share of every expert's bytes that a step of `tokens` tokens reads."""
        total, picked = self.experts
        return 1.0 - (1.0 - picked / total) ** tokens if total else 0.0

    def weight_bytes_read(self, tokens: int) -> float:
        return self.weight_bytes + self.expert_bytes * self.expert_share(tokens)

    def decode(self, batch: int, context: int) -> StepCost:
        """One token for each of `batch` sequences that attend to `context` keys."""
        return StepCost(
            self.weight_bytes_read(batch) + batch * context * self.kv_bytes_per_token,
            2 * (self.layer_params + self.head_params) * batch
            + self.attention_flops_per_key * batch * context,
        )

    def prefill(self, batch: int, length: int) -> StepCost:
        """`batch` prompts of `length` tokens, causal over their own keys."""
        keys_seen = length * (length + 1) // 2
        return StepCost(
            self.weight_bytes_read(batch * length) + batch * length * self.kv_bytes_per_token,
            2 * (self.layer_params * length + self.head_params) * batch
            + self.attention_flops_per_key * batch * keys_seen,
        )


def _median_seconds(work: Callable[[], object], repeats: int, device: torch.device) -> float:
    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # a GPU's work is queued: wait for it to finish

    work()  # first touch of the pages, thread pool start
    synchronize()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        synchronize()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)
