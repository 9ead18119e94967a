"""The compiled CPU backend: the torch backend with decode and short-chunk attention in a C++
kernel (paged_attention.cpp) that reads the context in place through the block tables, the
decoder's pointwise steps of small (decode) tensors as one C++ call each and greedy sampling's
argmax (pointwise.cpp), and its matmuls on weights packed once: for a C++ kernel in float32
(linear.cpp), for oneDNN in bfloat16 (linear.py).

The kernel is built with the system's C++ compiler (engine/kernels/cpu/build.py) at install
time or on first use. Importing this package neither builds nor loads it; `unavailable_reason`
does, and says in one line why the backend cannot run (no compiler, a failed build, not a CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.kernels.backend import KernelBackend


def unavailable_reason(device: torch.device) -> str | None:
    """Why the compiled CPU backend cannot run on `device`, in one line; None when it can."""
    if device.type != "cpu":
        return f"kernel backend 'cpu' runs on the CPU only, not on {str(device)!r}"
    from engine.kernels.cpu.build import KernelBuildError, load_library

    try:
        load_library()
    except KernelBuildError as exc:
        return f"kernel backend 'cpu' is unavailable ({exc}); kernel backend 'torch' needs no build"
    return None


@functools.cache
def backend() -> KernelBackend:
    from engine.kernels import attention_metadata
    from engine.kernels.cpu import attention, linear, pointwise
    from engine.kernels.torch_backend import TORCH_BACKEND

    return dataclasses.replace(
        TORCH_BACKEND,
        name="cpu",
        build_attention_metadata=functools.partial(
            attention_metadata.build_attention_metadata, in_place="table"
        ),
        paged_attention=attention.paged_attention,
        rms_norm=pointwise.rms_norm,
        rms_norm_per_head=pointwise.rms_norm_per_head,
        apply_rotary=pointwise.apply_rotary,
        silu_and_mul=pointwise.silu_and_mul,
        argmax_rows=pointwise.argmax_rows,
        set_max_threads=attention.set_max_threads,
        linear_for=linear.linear_for,
        output_projection=linear.output_projection,
    )
