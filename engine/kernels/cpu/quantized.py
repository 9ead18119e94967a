"""The compiled CPU backend's quantized weights: BlockCodes (engine/quantization/codes.py) packed
once into the layout of engine/quantization/layout.py, and the C++ kernel that reads it
(quantized_linear.cpp): x @ w^T + bias with the activations quantized to int8 per block of 32,
and the float32 rows of a quantized embedding table.

The kernel has three paths (AVX512-VNNI, AVX2, a scalar reference), picked at run time by what the
CPU supports; all give the same bits, and a row's result does not depend on the other rows of its
batch nor on the thread count. Its error against a float matmul of the dequantized weight is that
of rounding each activation to its block's int8 step (amax / 127): the tests bound it.
"""

from __future__ import annotations

import dataclasses
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import torch

from engine.kernels.cpu.build import load_library
from engine.quantization import layout
from engine.quantization.codes import BlockCodes

T = TypeVar("T", bound=np.generic)

# The kernel's `path` argument: 0 picks the fastest this CPU runs.
PATHS = {"scalar": 1, "avx2": 2, "avx512-vnni": 3}
ALIGNMENT = 64  # bytes: a record's 64-byte groups each in one cache line, one vector load


@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A [rows, k] weight in the kernel's layout: `data` holds layout.packed_bytes(rows, k, bits)
    bytes, 64-byte aligned."""

    bits: int
    rows: int
    k: int
    data: torch.Tensor  # uint8, CPU
    source: str  # BlockCodes.source: what it came from, for logs

    def __post_init__(self) -> None:
        expected = layout.packed_bytes(self.rows, self.k, self.bits)
        if self.data.dtype != torch.uint8 or self.data.numel() != expected:
            raise ValueError(
                f"{self.source}: {self.data.numel()} bytes of {self.data.dtype} for a "
                f"[{self.rows}, {self.k}] weight of {self.bits}-bit codes ({expected} bytes)"
            )
        if not self.data.is_contiguous() or self.data.data_ptr() % ALIGNMENT:
            raise ValueError(f"{self.source}: packed data not contiguous and 64-byte aligned")


def pack(codes: BlockCodes) -> PackedWeight:
    """codes in the kernel's layout: records [panel, block] of codes, 16 scales, 16 minimums."""
    rows, k = codes.shape
    if codes.bits == 4 and rows and int(codes.codes.max()) > 15:
        raise ValueError(f"{codes.source}: a 4-bit code above 15")
    panels, blocks = layout.panels(rows), k // layout.BLOCK
    padded = panels * layout.PANEL
    values = _padded(codes.codes, padded)
    # [panel, row in panel, block, group, value in group] -> [panel, block, group, row, value]
    grouped = values.reshape(panels, layout.PANEL, blocks, -1, layout.GROUP)
    grouped = grouped.transpose(0, 2, 3, 1, 4)
    if codes.bits == 4:  # group g's value in the low nibble, group g + 4's in the high one
        half = grouped.shape[2] // 2
        grouped = grouped[:, :, :half] | (grouped[:, :, half:] << np.uint8(4))
    area = grouped.reshape(panels, blocks, layout.CODE_BYTES[codes.bits])
    scales = _per_record(_padded(codes.scales, padded), panels, blocks)
    mins = _per_record(_padded(codes.mins, padded), panels, blocks)
    records = np.concatenate([area, scales, mins], axis=2)
    data = _aligned_bytes(records.size)
    data.copy_(torch.from_numpy(records.reshape(-1)))
    return PackedWeight(bits=codes.bits, rows=rows, k=k, data=data, source=codes.source)


def unpack(packed: PackedWeight) -> BlockCodes:
    """The BlockCodes `pack` was given (the inverse, for tests and checks)."""
    panels, blocks = layout.panels(packed.rows), packed.k // layout.BLOCK
    records = packed.data.numpy().reshape(panels, blocks, layout.RECORD_BYTES[packed.bits])
    area = records[:, :, : layout.CODE_BYTES[packed.bits]]
    grouped = area.reshape(panels, blocks, -1, layout.PANEL, layout.GROUP)
    if packed.bits == 4:
        grouped = np.concatenate([grouped & 0x0F, grouped >> 4], axis=2)
    # [panel, block, group, row, value] -> [panel, row, block, group, value]
    values = grouped.transpose(0, 3, 1, 2, 4).reshape(-1, packed.k)[: packed.rows]
    floats = records[:, :, layout.CODE_BYTES[packed.bits] :].copy().view(np.float32)
    floats = floats.reshape(panels, blocks, 2, layout.PANEL).transpose(2, 0, 3, 1)
    scales, mins = (part.reshape(-1, blocks)[: packed.rows] for part in floats)
    return BlockCodes(
        bits=packed.bits,
        codes=np.ascontiguousarray(values),
        scales=np.ascontiguousarray(scales),
        mins=np.ascontiguousarray(mins),
        source=packed.source,
    )


def quantized_linear(
    x: torch.Tensor,
    weight: PackedWeight,
    bias: torch.Tensor | None = None,
    path: int = 0,
    threads: int | None = None,
) -> torch.Tensor:
    """x [m, k] @ w^T + bias -> float32 [m, rows], on `threads` threads (None: torch's count).
    `path`: 0 the fastest this CPU runs, else PATHS' (RuntimeError where this CPU cannot run
    it)."""
    usable = (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.shape[1] == weight.k
        and x.stride(1) == 1
    )
    if not usable:
        raise ValueError(
            f"quantized_linear takes float32 CPU x [m, {weight.k}] with adjacent elements in a "
            f"row, got {x.dtype} {x.device.type} {tuple(x.shape)} strides {x.stride()}"
        )
    if bias is not None and not (
        bias.dtype == torch.float32
        and bias.device.type == "cpu"
        and bias.shape == (weight.rows,)
        and bias.is_contiguous()
    ):
        raise ValueError(
            f"quantized_linear takes a contiguous float32 CPU bias [{weight.rows}], got "
            f"{bias.dtype} {bias.device.type} {tuple(bias.shape)}"
        )
    out = x.new_empty(x.shape[0], weight.rows)
    status = load_library().engine_quantized_linear(
        x.data_ptr(), x.shape[0], weight.k, x.stride(0), weight.data.data_ptr(), weight.rows,
        weight.bits, None if bias is None else bias.data_ptr(), out.data_ptr(),
        torch.get_num_threads() if threads is None else threads, path,
    )  # fmt: skip
    if status == 2:
        raise RuntimeError(f"the quantized linear kernel's path {path} does not run on this CPU")
    if status != 0:
        raise RuntimeError(f"the quantized linear kernel failed (status {status})")
    return out


def embedding_rows(weight: PackedWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight in float32, [*ids.shape, k]: exactly BlockCodes.dequantize's."""
    flat = ids.reshape(-1).to(device="cpu", dtype=torch.int64).contiguous()
    out = torch.empty(flat.numel(), weight.k)
    status = load_library().engine_quantized_rows(
        weight.data.data_ptr(), weight.rows, weight.k, weight.bits, flat.data_ptr(), flat.numel(),
        out.data_ptr(),
    )  # fmt: skip
    if status == 3:
        low, high = int(flat.min()), int(flat.max())
        raise IndexError(f"row ids {low}..{high}: outside [0, {weight.rows})")
    if status != 0:
        raise RuntimeError(f"the quantized rows kernel failed (status {status})")
    return out.view(*ids.shape, weight.k)


def available_paths() -> list[str]:
    """The kernel's paths this CPU runs, slowest first (the scalar reference is always there)."""
    mask = load_library().engine_quantized_paths()
    return [name for name, code in PATHS.items() if mask & (1 << code)]


def _padded(array: npt.NDArray[T], rows: int) -> npt.NDArray[T]:
    """array with zero rows appended up to `rows` (a panel's unused rows)."""
    if array.shape[0] == rows:
        return array
    out = np.zeros((rows, *array.shape[1:]), dtype=array.dtype)
    out[: array.shape[0]] = array
    return out


def _per_record(values: npt.NDArray[T], panels: int, blocks: int) -> npt.NDArray[np.uint8]:
    """[padded rows, blocks] float32 -> [panel, block, 64 bytes]: a record's 16 values."""
    ordered = np.ascontiguousarray(
        values.astype(np.float32).reshape(panels, layout.PANEL, blocks).transpose(0, 2, 1)
    )
    return ordered.view(np.uint8).reshape(panels, blocks, layout.PANEL * 4)


def _aligned_bytes(size: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `size` bytes whose first byte is 64-byte aligned (a view
    into a slightly larger one: torch's CPU allocator aligns to 64 today, but does not promise)."""
    spare = torch.empty(size + ALIGNMENT, dtype=torch.uint8)
    start = -spare.data_ptr() % ALIGNMENT
    return spare[start : start + size]
