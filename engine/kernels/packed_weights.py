"""The packed copies of weights on the CPU: which weights get one, as a rule shared by the kernel
backends that make them (engine/kernels/torch_ops.packed_linear for oneDNN,
engine/kernels/cpu/linear.panel_linear for the compiled backend's float32 kernel,
engine/kernels/cpu/bf16_linear for its bfloat16 one) and the memory plan that counts them
(engine/model/placement/policy.packed_weight_bytes). Torch-free: the root plans without torch.

A packed copy is the weight again in another layout: the same number of bytes (the compiled
kernel's rounds a weight's rows up to a multiple of 16, at most 15 rows more).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable
from pathlib import Path

from engine.kernels.cpu.build import extra_flags

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


# The bfloat16 kernel's path every call takes (engine/kernels/cpu/bf16_linear.choose_path): a CPU
# without AVX512-BF16 imitated on one that has it.
BF16_PATH_VARIABLE = "ENGINE_BF16_LINEAR_PATH"


def packs_decoder(decoder_weight_bytes: int) -> bool:
    """Whether a rank whose decoder matmul weights take this many bytes packs them."""
    return decoder_weight_bytes <= PACKED_DECODER_LIMIT


def packed_copies(dtype: str) -> int:
    """Packed copies the compiled CPU backend makes of each packed weight of `dtype`: one for
    its own kernel, and for bfloat16 on a CPU with AMX a second, oneDNN's, whose AMX tiles run
    steps of many rows several times faster than the kernel (elsewhere oneDNN's bfloat16 matmul
    is no faster than the kernel's, or absent, and no copy is made for it). An AVX2 machine
    imitated on this one (kernels built with -mno-avx512f, or a bfloat16 kernel path chosen
    without AVX512-BF16) has no AMX either."""
    return 2 if dtype == "bfloat16" and cpu_has_amx() and not _imitates_avx2() else 1


def _imitates_avx2() -> bool:
    chosen = os.environ.get(BF16_PATH_VARIABLE, "best")
    return chosen not in ("best", "avx512-bf16") or "-mno-avx512f" in extra_flags()


@functools.cache
def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether this CPU has AMX's bfloat16 tiles (Linux; False where it cannot tell)."""
    try:
        with open(cpuinfo) as info:
            flags = next((line for line in info if line.startswith("flags")), "")
    except OSError:
        return False
    return "amx_bf16" in flags.split()
