"""The kernel backends by name, and the one place that picks one for a device.

The model calls only the functions bundled in a `KernelBackend`; `select_backend` decides which
implementation that is for a device. On the CPU that is the compiled backend (engine/kernels/cpu:
the torch backend with decode attention in a C++ kernel built on first use), or the torch
backend where it cannot be built; on CUDA the Triton backend, or the torch backend where Triton
is not installed. By name: the Triton backend (engine/kernels/triton: GPU, or its interpreter
on the CPU), torch, cpu. FlashInfer will plug in here with the same signatures.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch

from engine.kernels import batch_invariant
from engine.kernels.backend import KernelBackend
from engine.kernels.cpu import backend as cpu_kernels  # does not build or load the library
from engine.kernels.torch_backend import TORCH_BACKEND
from engine.kernels.triton import backend as triton_kernels  # does not import Triton itself

__all__ = ["BACKENDS", "select_backend"]

log = logging.getLogger(__name__)


# Deterministic mode (--deterministic): the torch backend with batch-invariant GEMMs and attention.
BATCH_INVARIANT_BACKEND = dataclasses.replace(
    TORCH_BACKEND,
    name="batch_invariant",
    build_attention_metadata=batch_invariant.build_attention_metadata,
    paged_attention=batch_invariant.paged_attention,
    linear=batch_invariant.linear,
    linear_for=batch_invariant.linear_for,
    output_projection=batch_invariant.output_projection,
)

BACKENDS: dict[str, KernelBackend] = {
    "torch": TORCH_BACKEND,
    "batch_invariant": BATCH_INVARIANT_BACKEND,
}
# Backends whose modules load only when selected: name -> (why not on this device, loader).
OPTIONAL_BACKENDS: dict[
    str, tuple[Callable[[torch.device], str | None], Callable[[], KernelBackend]]
] = {
    "triton": (triton_kernels.unavailable_reason, triton_kernels.backend),
    "cpu": (cpu_kernels.unavailable_reason, cpu_kernels.backend),
}


def select_backend(device: torch.device | str, name: str = "auto") -> KernelBackend:
    """The backend for `device`: `name` if given, else the best one available there."""
    device = torch.device(device)
    if name in OPTIONAL_BACKENDS:
        unavailable_reason, load = OPTIONAL_BACKENDS[name]
        reason = unavailable_reason(device)
        if reason is not None:
            raise ValueError(reason)
        return load()
    if name != "auto":
        if name not in BACKENDS:
            raise ValueError(
                f"unknown kernel backend {name!r}; expected 'auto' or one of "
                f"{sorted([*BACKENDS, *OPTIONAL_BACKENDS])}"
            )
        return BACKENDS[name]
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {str(device)!r}; expected 'cpu' or 'cuda'")
    backend = TORCH_BACKEND
    # Our own kernels where they run: the CPU's compiled ones, Triton's on a GPU (the torch
    # backend's decode path there is sparse products and gathers; tools/bench/gpu_check.sh
    # compares).
    own_kernels = cpu_kernels if device.type == "cpu" else triton_kernels
    reason = own_kernels.unavailable_reason(device)
    if reason is None:
        backend = own_kernels.backend()
    else:
        log.warning("%s: using kernel backend 'torch'", reason)
    log.debug("kernel backend for %s: %s", device, backend.name)
    return backend
