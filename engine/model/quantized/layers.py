"""The decoder's view of weights served quantized (engine/quantization): its linear layers, the
vocabulary projection and the embedding lookup, run by the CPU kernel on the packed codes
(engine/kernels/cpu/quantized.py). The kernel takes float32 activations; a model run in
bfloat16 converts on the way in and out (one small copy per matmul)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.kernels.backend import Linear

if TYPE_CHECKING:
    from engine.kernels.cpu.quantized import PackedWeight


def linear(packed: PackedWeight) -> Linear:
    """x, (ignored placeholder weight), bias -> x @ w^T + bias with w the packed weight."""
    from engine.kernels.cpu.quantized import quantized_linear

    def run(x: torch.Tensor, _weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.dtype == torch.float32:
            return quantized_linear(x, packed, bias)
        out = quantized_linear(x.float(), packed, None if bias is None else bias.float())
        return out.to(x.dtype)

    return run


def output_projection(packed: PackedWeight) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ table^T on every core given to the rank, whatever the step's thread count: one
    call of milliseconds (35 MB of the default model's codes) pays a helper's wake-up many times
    over, and the kernel's pool never waits for a helper whose core is taken. The gain shows
    with several rows; at one row the projection is short and the threads come out even."""
    from engine.kernels.cpu.attention import most_threads
    from engine.kernels.cpu.quantized import quantized_linear

    def project(x: torch.Tensor) -> torch.Tensor:
        out = quantized_linear(x.float(), packed, threads=most_threads())
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    return project


def embedding(packed: PackedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows of the quantized table for `ids` (any shape), decoded to `dtype`."""
    from engine.kernels.cpu.quantized import embedding_rows

    rows: torch.Tensor = embedding_rows(packed, ids.reshape(-1))
    return rows.to(dtype).reshape(*ids.shape, rows.shape[-1])
