"""The packed copies of weights on the CPU: which weights get one, as a rule shared by the kernel
backends that make them (engine/kernels/torch_ops.packed_linear for oneDNN,
engine/kernels/cpu/linear.panel_linear for the compiled backend's float32 kernel) and the memory
plan that counts them (engine/model/placement/policy.packed_weight_bytes). Torch-free: the root
plans without torch.

A packed copy is the weight again in another layout: the same number of bytes (the compiled
kernel's rounds a weight's rows up to a multiple of 16, at most 15 rows more).
"""

from __future__ import annotations

from collections.abc import Iterable

# Larger weights are not packed (a second copy of the widest matrices of a large model would
# cost more memory than the matmul saves time).
PACKED_WEIGHT_LIMIT = 256 << 20
# The decoder's matmul weights (the compiled CPU backend) are packed only while all of a rank's
# fit in this: a copy of up to 1 GiB is affordable on a serving host, a copy of a 7B model's
# 13 GB of bfloat16 decoder weights is not (vLLM-CPU drops the originals instead; here they stay,
# for the inputs the packed kernels leave to F.linear and, in bfloat16, for single tokens).
PACKED_DECODER_LIMIT = 1 << 30


def packed_copy_bytes(weight_bytes: Iterable[int]) -> int:
    """Bytes of the copies made for weights of these sizes."""
    return sum(size for size in weight_bytes if size <= PACKED_WEIGHT_LIMIT)


def packs_decoder(decoder_weight_bytes: int) -> bool:
    """Whether a rank whose decoder matmul weights take this many bytes packs them."""
    return decoder_weight_bytes <= PACKED_DECODER_LIMIT
