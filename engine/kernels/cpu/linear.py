"""The compiled CPU backend's matmuls: each float32 weight packed once into panels of 16 output
columns for the C++ kernel (linear.cpp), which serves steps of every size; bfloat16 weights packed
for oneDNN instead, used by steps of two tokens or more; float16 weights use F.linear.

The packed copies are a second copy of each weight (counted by the memory plan, and made for the
decoder only while a rank's decoder weights take at most PACKED_DECODER_LIMIT:
engine/kernels/packed_weights.py; a weight's packed rows are rounded up to 16, at most 15 rows
more).

The kernel takes float32 steps of every size, from one row up: oneDNN's per-call work (packing x,
choosing a kernel, a thread team) is a large share of a small step's short matmuls, and only at
prefill blocks of thousands of rows does oneDNN's own blocking draw level with the panels. For
half-precision weights oneDNN's call costs more than F.linear's, which a single token's matmul
does not win back, hence PACKED_FROM_TOKENS there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels import torch_ops
from engine.kernels.backend import Linear
from engine.kernels.cpu.build import load_library
from engine.kernels.packed_weights import PACKED_WEIGHT_LIMIT

PANEL = 16  # output columns per panel (linear.cpp's kPanel)
PACKED_FROM_TOKENS = 2  # for oneDNN's packed weights


def linear_for(weight: torch.Tensor) -> Linear:
    """x, weight, bias -> x @ weight.T + bias for this (loaded) weight."""
    kernel = panel_linear(weight)
    if kernel is not None:
        return PanelLinear(weight, kernel)
    onednn = torch_ops.packed_linear(weight)
    if onednn is None:  # not a CPU weight, an unsupported dtype, or no oneDNN in this torch
        return F.linear

    def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] < PACKED_FROM_TOKENS or w is not weight:
            return F.linear(x, w, bias)
        return onednn(x, bias)

    return onednn_linear


def output_projection(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T for the logits: the kernel for a float32 weight, else torch_ops'."""
    kernel = panel_linear(weight)
    if kernel is None:
        return torch_ops.output_projection(weight)
    return lambda x: kernel(x, None)


class Panels:
    """A float32 weight packed for linear.cpp: (x, bias=None) -> x @ weight.T + bias by the
    kernel; inputs it does not take go to F.linear."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.rows, self.width = weight.shape
        panels = -(-self.rows // PANEL)
        padded = weight.detach().new_zeros(panels * PANEL, self.width)
        padded[: self.rows] = weight.detach()
        # [panels, k, 16]: what engine_linear (and the fused decode step) read
        self.packed = padded.view(panels, PANEL, self.width).transpose(1, 2).contiguous()
        self.library = load_library()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows, width = self.rows, self.width
        usable = (
            x.dtype == torch.float32
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.shape[1] == width
            and x.stride(1) == 1
            and (
                bias is None
                or (bias.dtype == torch.float32 and bias.shape == (rows,) and bias.is_contiguous())
            )
        )
        if not usable:
            return F.linear(x, self.weight, bias)
        out = x.new_empty(x.shape[0], rows)
        if x.shape[0] == 0:
            return out
        status = self.library.engine_linear(
            x.data_ptr(),
            x.shape[0],
            width,
            x.stride(0),
            self.packed.data_ptr(),
            rows,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"the CPU linear kernel failed (status {status})")
        return out


class PanelLinear:
    """linear_for's answer for a weight the kernel takes: x, w, bias -> the kernel's x @ w.T +
    bias when w is that weight (F.linear for any other)."""

    def __init__(self, weight: torch.Tensor, panels: Panels) -> None:
        self.weight = weight
        self.panels = panels

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.panels(x, bias) if w is self.weight else F.linear(x, w, bias)


def panel_linear(weight: torch.Tensor) -> Panels | None:
    """The weight packed for the C++ kernel, for a float32 CPU weight of at most
    PACKED_WEIGHT_LIMIT bytes; else None."""
    usable = (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.numel() > 0
        and weight.numel() * weight.element_size() <= PACKED_WEIGHT_LIMIT
    )
    return Panels(weight) if usable else None
