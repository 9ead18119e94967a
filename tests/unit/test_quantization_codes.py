"""GGUF block types and float weights onto BlockCodes: the GGUF mappings against the `gguf`
package's own dequantizer (bit for bit, Q6_K within its documented bound), and the load-time
schemes within half a step per value."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize as reference_quantize

from engine.gguf import block_codes as gguf_codes
from engine.gguf.block_codes import (
    EXACT_TYPES,
    QUANTIZED_TYPES,
    block_codes,
    stays_float,
)
from engine.gguf.quants import LAYOUTS
from engine.quantization.quantize import ALIASES, SCHEMES, quantize, scheme_name
from tests.unit.test_gguf_quants import random_rows  # valid random blocks, finite scales

Floats = npt.NDArray[np.float32]
EPS = float(np.finfo(np.float32).eps)

# gguf-py quantizes only these; the K-quants are built from random bytes alone.
GGUF_QUANTIZES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
# d * 0 is -0.0 for a negative d in the reference, scale * code + min a +0.0: elsewhere the bits
# match, signed zeros included.
SIGNED_ZERO_DIFFERS = ("Q4_0", "Q5_0", "Q8_0")


def gguf_quantized_rows(
    type_name: str, rows: int, row_len: int, rng: np.random.Generator
) -> Floats:
    """Blocks as gguf-py quantizes a float weight, zero and constant blocks among them."""
    weight = rng.normal(size=(rows, row_len)).astype(np.float32)
    weight[0, :32] = 0
    weight[1, 32:64] = 0.75
    return np.asarray(reference_quantize(weight, GGMLQuantizationType[type_name]))


def same_bits(ours: Floats, theirs: Floats, type_name: str) -> bool:
    """Bit-equal, but for the sign of zeros where the mapping cannot keep it."""
    if type_name in SIGNED_ZERO_DIFFERS:
        ours, theirs = ours + np.float32(0), theirs + np.float32(0)  # -0.0 + 0.0 is +0.0
    return np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))


def reference(raw: np.ndarray, type_name: str) -> Floats:
    return np.asarray(reference_dequantize(raw, GGMLQuantizationType[type_name]), np.float32)


@pytest.mark.parametrize("type_name", EXACT_TYPES)
def test_random_blocks_decode_bit_equal_to_gguf(type_name: str) -> None:
    rng = np.random.default_rng(sum(map(ord, type_name)))
    row_len = 3 * LAYOUTS[type_name].block_size
    raw = random_rows(type_name, 7, row_len, rng)
    codes = block_codes(raw, type_name, (7, row_len))
    assert codes.bits == (4 if type_name in FOUR_BIT else 8)
    assert int(codes.codes.max()) < 1 << codes.bits
    assert codes.source == type_name
    assert same_bits(codes.dequantize(), reference(raw, type_name), type_name)


@pytest.mark.parametrize("type_name", GGUF_QUANTIZES)
def test_blocks_gguf_quantized_decode_bit_equal_to_gguf(type_name: str) -> None:
    raw = gguf_quantized_rows(type_name, 4, 96, np.random.default_rng(3))
    codes = block_codes(raw, type_name, (4, 96))
    assert same_bits(codes.dequantize(), reference(raw, type_name), type_name)


def q6_k_larger_steps(raw: npt.NDArray[np.uint8]) -> Floats:
    """Per block of 32 values, the larger of Q6_K's two steps |d * scale| (one per 16 values)."""
    blocks = raw.reshape(-1, LAYOUTS["Q6_K"].type_size)
    d = blocks[:, 208:210].view(np.float16).astype(np.float32)
    steps = np.abs(d * blocks[:, 192:208].view(np.int8).astype(np.float32))
    larger: Floats = steps.reshape(-1, 2).max(axis=1)
    return larger


def test_q6_k_is_requantized_within_half_a_step() -> None:
    raw = random_rows("Q6_K", 6, 512, np.random.default_rng(6))
    codes = block_codes(raw, "Q6_K", (6, 512))
    assert codes.bits == 8 and codes.source == "Q6_K (re-quantized to 8 bits)"
    exact = reference(raw, "Q6_K").reshape(-1, 32)
    error = np.abs(codes.dequantize().reshape(-1, 32) - exact)
    scale = codes.scales.reshape(-1, 1)
    rounding = 4 * EPS * np.abs(exact).max(axis=1, keepdims=True)
    assert np.all(error <= scale / 2 + rounding)
    # ... which is about an eighth of Q6_K's own step: 64 of them span at most 255 new ones.
    assert np.all(scale[:, 0] / 2 <= q6_k_larger_steps(raw) * 64 / 510 * (1 + 1e-6))


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_converting_in_chunks_with_a_ragged_tail_equals_one_pass(
    type_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    block = LAYOUTS[type_name].block_size
    raw = random_rows(type_name, 5, 4 * block, np.random.default_rng(1))
    whole = block_codes(raw, type_name, (5, 4 * block))
    monkeypatch.setattr(gguf_codes, "CHUNK_VALUES", 3 * block)  # 20 blocks: 6 chunks of 3, then 2
    chunked = block_codes(raw, type_name, (5, 4 * block))
    assert np.array_equal(chunked.codes, whole.codes)
    assert np.array_equal(chunked.scales, whole.scales)
    assert np.array_equal(chunked.mins, whole.mins)


def test_only_the_mapped_types_stay_quantized() -> None:
    assert set(QUANTIZED_TYPES) == {"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q6_K"}
    assert not any(stays_float(name) for name in QUANTIZED_TYPES)
    assert all(stays_float(name) for name in ("F32", "F16", "BF16", "Q2_K", "Q3_K", "IQ2_XS"))


def test_block_codes_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match=r"'F16' does not stay quantized; .*'Q4_K'"):
        block_codes(np.zeros(64, np.uint8), "F16", (1, 32))
    with pytest.raises(ValueError, match="needs 72 bytes, got 54"):
        block_codes(np.zeros(54, np.uint8), "Q4_0", (2, 64))
    with pytest.raises(ValueError, match="block size"):
        block_codes(np.zeros(144, np.uint8), "Q4_K", (2, 128))


def weight_with_special_blocks(rng: np.random.Generator) -> Floats:
    """Random rows of 96 values; row 0 starts with a zero block, row 1 with a constant one."""
    weight = (rng.normal(size=(5, 96)) * rng.uniform(0.01, 10, size=(5, 1))).astype(np.float32)
    weight[0, :32] = 0
    weight[1, :32] = -1.25
    return weight


def round_trip_error(weight: Floats, scheme: str) -> tuple[Floats, Floats, Floats]:
    """Per block of 32: |w - dequantized|, |scale| and the float32 rounding allowed on top."""
    codes = quantize(weight, scheme)
    blocks = weight.reshape(-1, 32)
    error = np.abs(codes.dequantize().reshape(-1, 32) - blocks)
    rounding = 4 * EPS * np.abs(blocks).max(axis=1, keepdims=True)
    return error, np.abs(codes.scales.reshape(-1, 1)), rounding


@pytest.mark.parametrize("scheme", ["q8_0", "q4_1"])
def test_quantize_is_within_half_a_step(scheme: str) -> None:
    weight = weight_with_special_blocks(np.random.default_rng(7))
    error, scale, rounding = round_trip_error(weight, scheme)
    assert np.all(error <= scale / 2 + rounding)


def test_q4_0_misses_by_a_whole_step_only_past_its_last_code() -> None:
    weight = weight_with_special_blocks(np.random.default_rng(8))
    codes = quantize(weight, "q4_0")
    error, scale, rounding = round_trip_error(weight, "q4_0")
    assert np.all(error <= scale + rounding)
    # Values within [min, min + 15 scale] (widened by half a step) round to the nearest code.
    scales, mins = codes.scales.reshape(-1, 1), codes.mins.reshape(-1, 1)
    ends = np.sort(np.concatenate([mins, mins + 15 * scales], axis=1), axis=1)
    blocks = weight.reshape(-1, 32)
    inside = (blocks >= ends[:, :1] - scale / 2) & (blocks <= ends[:, 1:] + scale / 2)
    assert np.all((error <= scale / 2 + rounding)[inside])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantize_codes_and_zero_blocks(scheme: str) -> None:
    weight = weight_with_special_blocks(np.random.default_rng(9))
    codes = quantize(weight, scheme)
    assert codes.bits == int(scheme[1])
    assert codes.codes.dtype == np.uint8 and int(codes.codes.max()) < 1 << codes.bits
    assert codes.scales.dtype == codes.mins.dtype == np.float32
    assert codes.source == f"{scheme} (from float32)"
    values = codes.dequantize()
    assert codes.scales[0, 0] == 0 and np.all(values[0, :32] == 0)
    assert np.all(values[1, :32] == np.float32(-1.25))


def test_q8_0_is_symmetric() -> None:
    weight = weight_with_special_blocks(np.random.default_rng(10))
    codes = quantize(weight, "q8_0")
    q = codes.codes.astype(np.int16) - 128
    assert q.min() >= -127 and q.max() <= 127
    assert np.array_equal(codes.mins, codes.scales * np.float32(-128))
    peaks = np.abs(q.reshape(-1, 32)).max(axis=1)
    assert np.all(peaks[codes.scales.reshape(-1) != 0] == 127)


def test_aliases_and_other_float_types() -> None:
    assert {name: scheme_name(name) for name in ALIASES} == {"int8": "q8_0", "int4": "q4_0"}
    assert scheme_name("Q4_1") == "q4_1"
    weight = weight_with_special_blocks(np.random.default_rng(11))
    half = quantize(weight.astype(np.float16), "int8")
    assert half.source == "q8_0 (from float16)"
    widened = quantize(weight.astype(np.float16).astype(np.float32), "q8_0")
    assert np.array_equal(half.codes, widened.codes)


def test_quantize_refuses_bad_input() -> None:
    weight = np.zeros((2, 64), np.float32)
    with pytest.raises(ValueError, match=r"unknown quantization scheme 'q2_k'; choices: .*'q4_1'"):
        quantize(weight, "q2_k")
    with pytest.raises(ValueError, match="rows of 48 values are not a multiple of 32"):
        quantize(np.zeros((2, 48), np.float32), "q8_0")
    with pytest.raises(ValueError, match="2-D float weight"):
        quantize(np.zeros(64, np.float32), "q8_0")
    with pytest.raises(ValueError, match="2-D float weight"):
        quantize(np.zeros((2, 64), np.int8), "q8_0")
