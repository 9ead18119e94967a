"""The Triton kernel backend (GPU): paged attention, KV stores and the decoder's row-wise ops.

Importing this package does not import Triton (CPU workers never pay for it); `backend()` does.
On a machine without a GPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1,
read when the kernel modules are first imported): that is how the tests check them against
the torch backend on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engine.kernels.backend import KernelBackend


def unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run on `device`, in one line; None when it can."""
    if importlib.util.find_spec("triton") is None:
        return (
            "kernel backend 'triton' needs the triton package (pip install 'engine[cuda]'); "
            "kernel backend 'torch' runs without it"
        )
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (
        f"kernel backend 'triton' cannot run on device {str(device)!r}: it needs a CUDA device, "
        "or TRITON_INTERPRET=1 to run its kernels in Triton's (slow) interpreter on the CPU; "
        "kernel backend 'torch' runs on the CPU"
    )


@functools.cache
def backend() -> KernelBackend:
    from engine.kernels.torch_backend import TORCH_BACKEND
    from engine.kernels.triton import attention, metadata, pointwise

    # cos/sin are computed once per step, and logits and the linears by matmuls: torch's stay.
    return dataclasses.replace(
        TORCH_BACKEND,
        name="triton",
        # Its metadata is a type of its own, read only by its own kernels.
        build_attention_metadata=metadata.build_triton_attention_metadata,  # type: ignore[arg-type]
        paged_attention=attention.paged_attention,
        rms_norm=pointwise.rms_norm,
        rms_norm_per_head=pointwise.rms_norm_per_head,
        apply_rotary=pointwise.apply_rotary,
        silu_and_mul=pointwise.silu_and_mul,
    )
