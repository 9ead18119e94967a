"""The compiled CPU backend's matmuls on weights packed once: each float32 weight into panels of
16 output columns for the C++ kernel (linear.cpp), which serves steps of every size; each bfloat16
weight into panels for the bfloat16 kernel (bf16_linear.py: AVX512-BF16, AVX2 or scalar), which
serves every step, except on a CPU with AMX, where oneDNN's packed matmul (its AMX tiles) takes
steps of ONEDNN_FROM_ROWS rows or more. A bfloat16 weight of odd width goes to oneDNN's packed
matmul from PACKED_FROM_TOKENS tokens and to F.linear below (oneDNN's call costs more than
F.linear's, which a single token's matmul does not win back); float16 weights to F.linear.

The packed copies are copies of each weight (counted by the memory plan, and made for the
decoder only while a rank's decoder weights take at most PACKED_DECODER_LIMIT:
engine/kernels/packed_weights.py; a weight's packed rows are rounded up to 16, at most 15 rows
more).

The float32 kernel takes steps of every size, from one row up: oneDNN's per-call work (packing
x, choosing a kernel, a thread team) is a large share of a small step's short matmuls, and only at
prefill blocks of thousands of rows does oneDNN's own blocking draw level with the panels.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels import torch_ops
from engine.kernels.backend import Linear
from engine.kernels.cpu.bf16_linear import Bf16Panels, bf16_panels, chosen_path
from engine.kernels.cpu.build import load_library
from engine.kernels.packed_weights import PACKED_WEIGHT_LIMIT, packed_copies

log = logging.getLogger(__name__)

PANEL = 16  # output columns per panel (linear.cpp's kPanel)
PACKED_FROM_TOKENS = 2  # for oneDNN's packed weights
# From this many rows a bfloat16 step goes to oneDNN on a CPU with AMX (packed_copies): its AMX
# tiles do a 64-row step several times faster than AVX512-BF16's dot products, while at a few
# rows oneDNN's per-call work costs more than the kernel's whole step.
ONEDNN_FROM_ROWS = 16


def linear_for(weight: torch.Tensor) -> Linear:
    """x, weight, bias -> x @ weight.T + bias for this (loaded) weight."""
    kernel = panel_linear(weight)
    if kernel is not None:
        return PanelLinear(weight, kernel)
    half = bf16_panels(weight)
    if half is not None and weight.numel() * weight.element_size() <= PACKED_WEIGHT_LIMIT:
        return Bf16Linear(weight, half, _onednn_bf16(weight))
    onednn = torch_ops.packed_linear(weight)
    if onednn is None:  # not a CPU weight, an unsupported dtype, or no oneDNN in this torch
        return F.linear

    def onednn_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.shape[0] < PACKED_FROM_TOKENS or w is not weight:
            return F.linear(x, w, bias)
        return onednn(x, bias)

    return onednn_linear


def output_projection(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T for the logits: the kernels for a float32 or bfloat16 weight (float32
    logits from both), else torch_ops'."""
    kernel = panel_linear(weight)
    if kernel is not None:
        return lambda x: kernel(x, None)
    half = bf16_panels(weight)
    if half is None or weight.numel() * weight.element_size() > PACKED_WEIGHT_LIMIT:
        return torch_ops.output_projection(weight)
    onednn = _onednn_bf16(weight)

    def project(x: torch.Tensor) -> torch.Tensor:
        if onednn is not None and x.shape[0] >= ONEDNN_FROM_ROWS and x.dtype == weight.dtype:
            return onednn(x).float()
        return half(x, None, out_dtype=torch.float32)

    return project


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


def _onednn_bf16(weight: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """oneDNN's packed matmul of a bfloat16 weight, where the CPU has AMX (packed_copies)."""
    _log_bf16_paths()
    return torch_ops.packed_linear(weight) if packed_copies("bfloat16") > 1 else None


@functools.cache
def _log_bf16_paths() -> None:
    """Says once, at the first bfloat16 weight packed, which paths its matmuls take here."""
    onednn = (
        f"; from {ONEDNN_FROM_ROWS} rows oneDNN's (AMX)" if packed_copies("bfloat16") > 1 else ""
    )
    log.info("bfloat16 matmuls: the %s path of bf16_linear.cpp%s", chosen_path(), onednn)


class Bf16Linear:
    """linear_for's answer for a bfloat16 weight: x, w, bias -> x @ w.T + bias by the bfloat16
    kernel, or by oneDNN (`onednn`, where it packed the weight) from ONEDNN_FROM_ROWS rows; F.linear
    for any other weight."""

    def __init__(
        self, weight: torch.Tensor, panels: Bf16Panels, onednn: Callable[..., torch.Tensor] | None
    ) -> None:
        self.weight = weight
        self.panels = panels
        self.onednn = onednn

    def __call__(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if w is not self.weight:
            return F.linear(x, w, bias)
        if self.onednn is not None and x.shape[0] >= ONEDNN_FROM_ROWS and x.dtype == w.dtype:
            return self.onednn(x, bias)
        return self.panels(x, bias)


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
