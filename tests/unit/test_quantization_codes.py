"""Float weights quantized at load (the --quantization schemes) onto BlockCodes: each value
within half a step of its code (q4_0 as ggml rounds it), zero and constant blocks exact. (A GGUF
file's own block types are packed as they are: tests/unit/test_quantized_kernel.py.)"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest

from engine.quantization.codes import concatenate
from engine.quantization.quantize import ALIASES, SCHEMES, quantize, scheme_name

Floats = npt.NDArray[np.float32]
EPS = float(np.finfo(np.float32).eps)


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


def test_codes_of_one_width_join_and_of_two_do_not() -> None:
    weight = weight_with_special_blocks(np.random.default_rng(12))
    four, other = quantize(weight, "q4_1"), quantize(weight[:2], "q4_0")
    joined = concatenate([four, other])
    assert joined.shape == (7, 96) and joined.source == "q4_0 (from float32)+q4_1 (from float32)"
    assert np.array_equal(
        joined.dequantize(), np.concatenate([four.dequantize(), other.dequantize()])
    )
    with pytest.raises(ValueError, match="cannot join codes of"):
        concatenate([four, quantize(weight, "q8_0")])
