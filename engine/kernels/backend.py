"""What a kernel backend provides: the functions the model calls, bundled (one per backend)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from engine.kernels.attention_metadata import AttentionMetadata

# x, weight, bias -> x @ weight.T + bias
Linear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class KernelBackend:
    name: str
    build_attention_metadata: Callable[..., AttentionMetadata]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rms_norm_per_head: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    rotary_cos_sin: Callable[
        [torch.Tensor, torch.Tensor, torch.dtype], tuple[torch.Tensor, torch.Tensor]
    ]
    apply_rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # x @ weight.T + bias, for the decoder's linear layers
    linear: Linear
    output_projection: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]
    # logits [rows, vocab] -> int64 [rows]: each row's greedy token, as torch.argmax(dim=-1)
    argmax_rows: Callable[[torch.Tensor], torch.Tensor]
    # Told the cores given to this rank, for kernels with threads of their own (None: none do).
    set_max_threads: Callable[[int], None] | None = None
    # The linear for one loaded weight, prepared once (its weight packed); None: `linear`.
    linear_for: Callable[[torch.Tensor], Linear] | None = None

    def prepared_linear(self, weight: torch.Tensor) -> Linear:
        return self.linear if self.linear_for is None else self.linear_for(weight)
