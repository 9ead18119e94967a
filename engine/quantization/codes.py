"""A float weight quantized at load (engine/quantization/quantize.py) before packing: integer
codes with a float32 scale and minimum per block of 32 values of a row, w = scale * code +
minimum. The CPU kernel packs it in the U4 or U8 format (engine/quantization/layout.py; a GGUF
file's tensors keep their own types: engine/gguf/native_blocks.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import numpy.typing as npt

from engine.quantization.layout import BLOCK


@dataclasses.dataclass
class BlockCodes:
    bits: int  # 4 (codes 0-15) or 8 (codes 0-255)
    codes: npt.NDArray[np.uint8]  # [rows, k], one code per value (not nibble-packed)
    scales: npt.NDArray[np.float32]  # [rows, k // 32]
    mins: npt.NDArray[np.float32]  # [rows, k // 32]
    source: str  # what it came from, for logs and /metrics: "Q4_1", "q8_0 (from float32)", ...

    def __post_init__(self) -> None:
        rows, k = self.codes.shape
        if self.bits not in (4, 8) or k % BLOCK:
            raise ValueError(f"{self.source}: {self.bits}-bit codes of {k} values per row")
        if self.scales.shape != (rows, k // BLOCK) or self.mins.shape != (rows, k // BLOCK):
            raise ValueError(f"{self.source}: scales {self.scales.shape} for codes {(rows, k)}")

    @property
    def shape(self) -> tuple[int, int]:
        rows, k = self.codes.shape
        return rows, k

    def dequantize(self) -> npt.NDArray[np.float32]:
        """w = scale * code + minimum, in float32 (for references and for the float fallback)."""
        rows, k = self.codes.shape
        values = self.codes.reshape(rows, k // BLOCK, BLOCK).astype(np.float32)
        values *= self.scales[:, :, None]
        values += self.mins[:, :, None]
        return values.reshape(rows, k)


def concatenate(parts: list[BlockCodes]) -> BlockCodes:
    """Row-wise concatenation (the fused q|k|v and gate|up weights, all of one scheme)."""
    bits = parts[0].bits
    if any(part.bits != bits for part in parts):
        raise ValueError(f"cannot join codes of {sorted({part.bits for part in parts})} bits")
    sources = sorted({part.source for part in parts})
    return BlockCodes(
        bits=bits,
        codes=np.concatenate([part.codes for part in parts]),
        scales=np.concatenate([part.scales for part in parts]),
        mins=np.concatenate([part.mins for part in parts]),
        source="+".join(sources),
    )
