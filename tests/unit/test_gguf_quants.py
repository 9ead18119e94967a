"""engine.gguf.quants against the `gguf` package's own dequantizer, bit for bit."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as reference_dequantize

from engine.gguf import quants
from engine.gguf.quants import LAYOUTS, SUPPORTED_TYPES, dequantize, row_nbytes

# Byte offsets of each type's float16 scales: random bytes there could be inf or NaN, which the
# test would then compare instead of the decoding.
FP16_SCALES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_NL": (0,),
    "IQ4_XS": (0,),
}


def random_rows(
    type_name: str, rows: int, row_len: int, rng: np.random.Generator
) -> npt.NDArray[np.uint8]:
    """(rows, bytes per row) of random blocks whose scales are finite float16 values."""
    raw = rng.integers(0, 256, size=(rows, row_nbytes(type_name, row_len)), dtype=np.uint8)
    blocks = raw.reshape(-1, LAYOUTS[type_name].type_size)
    for at in FP16_SCALES.get(type_name, ()):
        scales = rng.uniform(-4, 4, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, at : at + 2] = scales.view(np.uint8)
    return raw


def bits(values: npt.NDArray[np.float32]) -> npt.NDArray[np.uint32]:
    return values.view(np.uint32)  # compares NaN payloads and signed zeros too


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_random_blocks_decode_bit_equal_to_gguf(type_name: str) -> None:
    rng = np.random.default_rng(sum(map(ord, type_name)))
    row_len = 3 * LAYOUTS[type_name].block_size
    raw = random_rows(type_name, 7, row_len, rng)
    ours = dequantize(raw, type_name, (7, row_len))
    reference = reference_dequantize(raw, GGMLQuantizationType[type_name])
    assert ours.dtype == np.float32
    assert ours.shape == reference.shape == (7, row_len)
    assert np.array_equal(bits(ours), bits(reference))


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_decoding_in_chunks_with_a_ragged_tail_equals_one_pass(
    type_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(1)
    block = LAYOUTS[type_name].block_size
    raw = random_rows(type_name, 5, 4 * block, rng)
    whole = dequantize(raw, type_name, (5, 4 * block))
    monkeypatch.setattr(quants, "CHUNK_VALUES", 3 * block)  # 20 blocks: 6 chunks of 3, then 2
    assert np.array_equal(bits(dequantize(raw, type_name, (5, 4 * block))), bits(whole))


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
def test_row_nbytes_matches_ggml_block_sizes(type_name: str) -> None:
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    assert (LAYOUTS[type_name].block_size, LAYOUTS[type_name].type_size) == (block_size, type_size)
    assert row_nbytes(type_name, 5 * block_size) == 5 * type_size


def test_float_types_decode_any_row_length() -> None:
    values = np.arange(-3, 4, dtype=np.float32).reshape(7, 1)
    assert np.array_equal(dequantize(values.view(np.uint8), "F32", (7, 1)), values)
    assert np.array_equal(
        dequantize(values.astype(np.float16).view(np.uint8), "F16", (7,)), values[:, 0]
    )


def test_a_row_that_splits_a_block_is_refused() -> None:
    with pytest.raises(
        ValueError, match=r"48 values is not a multiple of Q4_0's block size \(32\)"
    ):
        row_nbytes("Q4_0", 48)
    raw = np.zeros(2 * 2 * 18, np.uint8)  # as many bytes as four blocks, but rows of 48
    with pytest.raises(ValueError, match="block size"):
        dequantize(raw, "Q4_0", (2, 48))


def test_a_byte_count_that_disagrees_with_the_shape_is_refused() -> None:
    with pytest.raises(ValueError, match="needs 72 bytes, got 54"):
        dequantize(np.zeros(54, np.uint8), "Q4_0", (2, 64))


def test_an_unsupported_type_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'IQ2_XS' is not supported; supported: .*'Q4_K'"):
        dequantize(np.zeros(66, np.uint8), "IQ2_XS", (256,))


def test_decodes_into_a_given_array() -> None:
    raw = random_rows("Q4_K", 2, 256, np.random.default_rng(2))
    out = np.empty((2, 256), np.float32)
    assert dequantize(raw, "Q4_K", (2, 256), out) is out
    assert np.array_equal(bits(out), bits(dequantize(raw, "Q4_K", (2, 256))))
    with pytest.raises(ValueError, match="C-contiguous float32 array of shape"):
        dequantize(raw, "Q4_K", (2, 256), np.empty((256, 2), np.float32).T)
