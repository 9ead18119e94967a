"""The torch backend: plain torch ops for every function of a KernelBackend. It runs wherever
torch does, and the other backends are it with some of its functions replaced."""

from __future__ import annotations

import torch.nn.functional as F

from engine.kernels import attention_metadata, torch_attention, torch_ops
from engine.kernels.backend import KernelBackend

TORCH_BACKEND = KernelBackend(
    name="torch",
    build_attention_metadata=attention_metadata.build_attention_metadata,
    paged_attention=torch_attention.paged_attention,
    rms_norm=torch_ops.rms_norm,
    rms_norm_per_head=torch_ops.rms_norm_per_head,
    rotary_cos_sin=torch_ops.rotary_cos_sin,
    apply_rotary=torch_ops.apply_rotary,
    silu_and_mul=torch_ops.silu_and_mul,
    linear=F.linear,
    output_projection=torch_ops.output_projection,
    argmax_rows=torch_ops.argmax_rows,
)
