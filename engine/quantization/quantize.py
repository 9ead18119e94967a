"""Float weights quantized at load (the `--quantization` schemes), onto BlockCodes.

Each scheme quantizes every block of 32 consecutive values of a row on its own, with a float32
scale and minimum (a file format would round them to float16; nothing here is written to one,
so the values keep the precision the kernel reads):

- q8_0: symmetric 8-bit, d = max |w| / 127, q = round(w / d) in [-127, 127]; code q + 128 and
  minimum -128 d, so that w = d * code + minimum = d * q.
- q4_0: symmetric 4-bit as ggml forms it: d = (the value of largest magnitude, sign included)
  / -8, codes 0..15 for q + 8. That value lands exactly on code 0, but the other side reaches
  only 7 d: a value past 7.5 d there is clipped to code 15 and misses by up to one step, not half.
- q4_1: asymmetric 4-bit, scale = (max - min) / 15 and minimum = the block's minimum: every
  value is within half a step (scale / 2) of its code.

A block of zeros gets scale 0 and codes that decode to 0; a constant block decodes exactly.
Blocks are quantized a chunk at a time, so that the temporaries stay a few MiB.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from engine.quantization.codes import BlockCodes
from engine.quantization.layout import BLOCK

Floats = npt.NDArray[np.float32]
Codes = npt.NDArray[np.uint8]
# (blocks, 32) float32 -> writes codes (blocks, 32), scales (blocks, 1), minimums (blocks, 1)
Quantizer = Callable[[Floats, Codes, Floats, Floats], None]

CHUNK_VALUES = 1 << 19  # values quantized per chunk: temporaries of a few MiB
SCHEMES: tuple[str, ...] = ("q8_0", "q4_0", "q4_1")
# Names other tools use for the same thing: vLLM-style int8 / int4 are the symmetric schemes.
ALIASES: dict[str, str] = {"int8": "q8_0", "int4": "q4_0"}


def scheme_name(scheme: str) -> str:
    """The scheme a name asks for (an alias resolved, case ignored), or a ValueError."""
    name = scheme.lower()
    name = ALIASES.get(name, name)
    if name not in SCHEMES:
        raise ValueError(
            f"unknown quantization scheme {scheme!r}; choices: {SCHEMES} "
            f"(aliases: {', '.join(f'{a} = {s}' for a, s in ALIASES.items())})"
        )
    return name


def quantize(weight: np.ndarray, scheme: str) -> BlockCodes:
    """Quantize a float weight [rows, k] (k a multiple of 32) with a scheme of SCHEMES."""
    name = scheme_name(scheme)
    bits, quantizer = _QUANTIZERS[name]
    if weight.ndim != 2 or not np.issubdtype(weight.dtype, np.floating):
        raise ValueError(f"{name}: expected a 2-D float weight, got {weight.dtype} {weight.shape}")
    rows, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"{name}: rows of {k} values are not a multiple of {BLOCK}")
    blocks = np.ascontiguousarray(weight).reshape(-1, BLOCK)
    codes = np.empty((rows, k), np.uint8)
    scales = np.empty((rows, k // BLOCK), np.float32)
    mins = np.empty((rows, k // BLOCK), np.float32)
    # Views over whole blocks: each chunk writes its slice of the three outputs in place.
    code_blocks, scale_blocks, min_blocks = (
        codes.reshape(-1, BLOCK),
        scales.reshape(-1, 1),
        mins.reshape(-1, 1),
    )
    step = CHUNK_VALUES // BLOCK
    for start in range(0, blocks.shape[0], step):
        part = slice(start, start + step)
        values = np.asarray(blocks[part], dtype=np.float32)  # a copy only for other float types
        quantizer(values, code_blocks[part], scale_blocks[part], min_blocks[part])
    return BlockCodes(bits, codes, scales, mins, source=f"{name} (from {weight.dtype})")


def reciprocal(step: Floats) -> Floats:
    """1 / step, and 0 where the step is 0 (a constant block): all its codes then come out 0."""
    out = np.zeros_like(step)
    np.divide(np.float32(1), step, out=out, where=step != 0)
    return out


def quantize_asymmetric(
    values: Floats, levels: int, codes: Codes, scales: Floats, mins: Floats
) -> None:
    """Codes 0..levels spanning each block's [min, max]: scale = (max - min) / levels.

    Every value is within scale / 2 of scale * code + min, up to float32 rounding (a few ulps
    of the block's magnitude).
    """
    low = values.min(axis=1, keepdims=True)
    scale = (values.max(axis=1, keepdims=True) - low) / np.float32(levels)
    scaled = values - low
    scaled *= reciprocal(scale)
    np.rint(scaled, out=scaled)
    # (max - min) * (1 / scale) may round a hair past `levels`: the clip keeps the code in range.
    np.clip(scaled, 0, levels, out=scaled)
    codes[...] = scaled
    scales[...] = scale
    mins[...] = low


def _q8_0(values: Floats, codes: Codes, scales: Floats, mins: Floats) -> None:
    d = np.abs(values).max(axis=1, keepdims=True) / np.float32(127)
    q = values * reciprocal(d)
    np.rint(q, out=q)
    np.clip(q, -127, 127, out=q)
    q += np.float32(128)
    codes[...] = q
    scales[...] = d
    np.multiply(d, np.float32(-128), out=mins)


def _q4_0(values: Floats, codes: Codes, scales: Floats, mins: Floats) -> None:
    peak = np.take_along_axis(values, np.abs(values).argmax(axis=1)[:, None], axis=1)
    d = peak / np.float32(-8)
    q = values * reciprocal(d)
    # ggml's rounding: to nearest with ties up, offset by 8 (the peak lands on 0).
    q += np.float32(8.5)
    np.floor(q, out=q)
    np.clip(q, 0, 15, out=q)
    codes[...] = q
    scales[...] = d
    np.multiply(d, np.float32(-8), out=mins)


def _q4_1(values: Floats, codes: Codes, scales: Floats, mins: Floats) -> None:
    quantize_asymmetric(values, 15, codes, scales, mins)


_QUANTIZERS: dict[str, tuple[int, Quantizer]] = {
    "q8_0": (8, _q8_0),
    "q4_0": (4, _q4_0),
    "q4_1": (4, _q4_1),
}
