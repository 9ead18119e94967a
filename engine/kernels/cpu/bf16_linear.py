"""The compiled CPU backend's bfloat16 matmuls: a bfloat16 weight packed once into panels of 16
output columns in pairs along k for the C++ kernel (bf16_linear.cpp), which reads it in 16 bits
(half float32's bytes) on every CPU: with AVX512-BF16's dot products where the CPU has them,
widened to float32 in registers with FMA on AVX2, and a scalar reference elsewhere. Every path
gives the same bits, and a row's result does not depend on the other rows or the thread count.

Activations are bfloat16 (a float32 input is rounded to it first); outputs bfloat16 for the
decoder's matmuls, float32 for the logits.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from engine.kernels.cpu.attention import DTYPE_CODES
from engine.kernels.cpu.build import load_library
from engine.kernels.packed_weights import BF16_PATH_VARIABLE

PANEL = 16  # output columns per panel (bf16_linear.cpp's kPanel)
# The kernel's `path` argument: 0 picks the fastest this CPU runs.
PATHS = {"scalar": 1, "avx2": 2, "avx512-bf16": 3}


def choose_path(name: str) -> None:
    """Make `name` (PATHS, or "best") the path every call takes that asks for none, the fused
    decode step's included: tests imitate a CPU without AVX512-BF16 on one that has it. The
    environment's ENGINE_BF16_LINEAR_PATH sets it when the library loads."""
    code = 0 if name == "best" else PATHS.get(name)
    if code is None or load_library().engine_bf16_linear_choose(code) != 0:
        raise ValueError(
            f"bfloat16 linear path {name!r} does not run on this CPU; expected 'best' or one of "
            f"{', '.join(available_paths())}"
        )


@functools.cache
def _path_from_environment() -> None:
    name = os.environ.get(BF16_PATH_VARIABLE)
    if name:
        choose_path(name)


def available_paths() -> list[str]:
    """The kernel's paths this CPU runs, slowest first (the scalar reference is always there)."""
    mask = load_library().engine_bf16_linear_paths()
    return [name for name, bit in PATHS.items() if mask & (1 << bit)]


def chosen_path() -> str:
    """The path a call with path 0 takes on this CPU (the fastest this build runs, unless one was
    chosen)."""
    _path_from_environment()
    code = load_library().engine_bf16_linear_best()
    return next(name for name, path in PATHS.items() if path == code)


class Bf16Panels:
    """A bfloat16 weight [n, k] (k even) packed for bf16_linear.cpp: (x, bias=None) -> x @ W.T +
    bias by the kernel, in x's dtype (or `out_dtype`); inputs it does not take go to F.linear."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.rows, self.width = weight.shape
        panels = -(-self.rows // PANEL)
        padded = weight.detach().new_zeros(panels * PANEL, self.width)
        padded[: self.rows] = weight.detach()
        # [panels, k / 2, 16, 2]: a pair of k for 16 columns side by side
        pairs = padded.view(panels, PANEL, self.width // 2, 2).transpose(1, 2)
        self.packed = pairs.contiguous()
        self.library = load_library()
        _path_from_environment()

    def __call__(
        self,
        x: torch.Tensor,
        bias: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None,
        path: int = 0,
    ) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        usable = (
            x.dtype in (torch.float32, torch.bfloat16)
            and out_dtype in (torch.float32, torch.bfloat16)
            and x.device.type == "cpu"
            and x.dim() == 2
            and x.shape[1] == self.width
            and x.stride(1) == 1
            and (bias is None or bias.shape == (self.rows,))
        )
        if not usable:
            return F.linear(x, self.weight, bias).to(out_dtype)
        out = x.new_empty(x.shape[0], self.rows, dtype=out_dtype)
        if x.shape[0] == 0:
            return out
        bias32 = None if bias is None else bias.float().contiguous()
        status = self.library.engine_bf16_linear(
            DTYPE_CODES[x.dtype],
            x.data_ptr(),
            x.shape[0],
            self.width,
            x.stride(0),
            self.packed.data_ptr(),
            self.rows,
            None if bias32 is None else bias32.data_ptr(),
            DTYPE_CODES[out_dtype],
            out.data_ptr(),
            torch.get_num_threads(),
            path,
        )
        if status != 0:
            raise RuntimeError(f"the bfloat16 linear kernel failed (status {status}, path {path})")
        return out


def bf16_panels(weight: torch.Tensor) -> Bf16Panels | None:
    """The weight packed for the kernel, for a bfloat16 CPU weight [n, k] of an even k; else
    None."""
    usable = (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and weight.numel() > 0
        and weight.shape[1] % 2 == 0
    )
    return Bf16Panels(weight) if usable else None
