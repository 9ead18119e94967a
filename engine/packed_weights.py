"""The oneDNN copies of weights on the CPU: which weights get one, as a rule shared by the kernel
backends that make them (engine/kernels/torch_ops.packed_linear) and the memory plan that counts
them (engine/model/placement.packed_weight_bytes). Torch-free: the root plans without torch.

A packed copy is the weight again, in oneDNN's blocked layout: the same number of bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

# Larger weights are not packed (a second copy of the widest matrices of a large model would
# cost more memory than the matmul saves time).
PACKED_WEIGHT_LIMIT = 256 << 20


def packed_copy_bytes(weight_bytes: Iterable[int]) -> int:
    """Bytes of the copies made for weights of these sizes."""
    return sum(size for size in weight_bytes if size <= PACKED_WEIGHT_LIMIT)
