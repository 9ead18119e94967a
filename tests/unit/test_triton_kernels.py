"""The Triton kernel backend against the torch backend, on CPU tensors in Triton's interpreter.

TRITON_INTERPRET=1 must be set before the kernel modules are imported (triton.jit reads it when
it decorates), so it is set here, at the top of the module. Shapes stay small: the interpreter
runs every program of a grid one after the other in numpy.

ENGINE_TEST_DEVICE=cuda runs the same checks compiled on a GPU against the torch backend there
(torch's SDPA), with float16 added (tools/bench/gpu_check.sh); the suite itself runs on the CPU.
"""

from __future__ import annotations

import dataclasses
import os

DEVICE_NAME = os.environ.get("ENGINE_TEST_DEVICE", "cpu")
if DEVICE_NAME == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed (pip install 'engine[test]')")

from engine.kernels.kv_cache import PagedKVCache  # noqa: E402
from engine.kernels.registry import select_backend  # noqa: E402
from engine.kernels.triton import decode_attention  # noqa: E402
from engine.kernels.triton.pointwise import fused_add_rms_norm  # noqa: E402

CPU = torch.device("cpu")
DEVICE = torch.device(DEVICE_NAME)
ON_GPU = DEVICE.type == "cuda"
TRITON = select_backend(DEVICE, "triton")
TORCH = select_backend(DEVICE, "torch")
# bfloat16 keeps 8 bits of mantissa: one rounding moves a value by up to 2**-8 of it, and the
# interpreter's float32 -> bfloat16 cast truncates (a GPU rounds to nearest): up to 2**-7.
# float16 keeps 11 bits: 2**-10 of a value per rounding, a few roundings per output.
TOLERANCE = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 4e-3, "rtol": 4e-3},
}
# float16 is a GPU serving dtype; on the CPU the interpreter adds nothing bfloat16 doesn't test.
DTYPES = [torch.float32, torch.bfloat16, *([torch.float16] if ON_GPU else [])]


def make_cache(
    kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int, num_blocks: int = 96
) -> PagedKVCache:
    cache = PagedKVCache(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=DEVICE,
    )
    # Unwritten slots hold NaN: a read of one that is not masked away poisons the output.
    cache.storage[:, :, : cache.null_slot].fill_(float("nan"))
    return cache


def copy_of(cache: PagedKVCache) -> PagedKVCache:
    twin = make_cache(
        cache.keys[0].shape[1],
        cache.keys[0].shape[2],
        cache.storage.dtype,
        cache.block_size,
        cache.num_blocks,
    )
    twin.storage.copy_(cache.storage)
    return twin


def check_step(
    chunks: list[tuple[int, int]],
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int = 8,
    seed: int = 0,
) -> None:
    """chunks: (start_pos, query_len) per sequence. Their cached prefixes are written to
    scattered blocks first; then one step runs them all through both backends, which must
    agree on every output row and on what they stored in the cache."""
    generator = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(s + n) // block_size) for s, n in chunks) + 4
    cache = make_cache(kv_heads, head_dim, dtype, block_size, num_blocks)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    tables = []
    for start, length in chunks:
        table = [free_blocks.pop() for _ in range(-(-(start + length) // block_size))]
        tables.append(table)
        if start:
            slots = torch.tensor(
                [table[p // block_size] * block_size + p % block_size for p in range(start)]
            )
            prefix = torch.randn(2, start, kv_heads, head_dim, generator=generator).to(dtype)
            cache.write(0, slots.to(DEVICE), prefix[0].to(DEVICE), prefix[1].to(DEVICE))
    tokens = sum(n for _, n in chunks)
    # query, key and value as the model passes them: strided views of one fused projection.
    qkv = torch.randn(tokens, heads + 2 * kv_heads, head_dim, generator=generator)
    qkv = qkv.to(DEVICE, dtype)
    query, key, value = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    scale = head_dim**-0.5

    ours_cache = copy_of(cache)
    meta = TRITON.build_attention_metadata(
        [n for _, n in chunks],
        [s for s, _ in chunks],
        tables,
        cache=ours_cache,
        queries_per_kv=heads // kv_heads,
        device=DEVICE,
    )
    ours = TRITON.paged_attention(query, key, value, ours_cache, 0, meta, scale)

    # The torch backend takes no empty chunk: they add no rows, so leave them out.
    kept = [(chunk, table) for chunk, table in zip(chunks, tables, strict=True) if chunk[1]]
    reference_meta = TORCH.build_attention_metadata(
        [n for (_, n), _ in kept],
        [s for (s, _), _ in kept],
        [table for _, table in kept],
        cache=cache,
        queries_per_kv=heads // kv_heads,
        device=DEVICE,
    )
    expected = TORCH.paged_attention(query, key, value, cache, 0, reference_meta, scale)

    assert ours.shape == expected.shape == (tokens, heads * head_dim)
    torch.testing.assert_close(ours_cache.storage, cache.storage, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(ours, expected, **TOLERANCE[dtype])


# One step mixing what a scheduler sends: decodes at and across block edges, a fresh prompt,
# an empty chunk, a one-token prompt, and prefill chunks after cached context.
MIXED_STEP = [(7, 1), (8, 1), (0, 11), (5, 0), (0, 1), (16, 9), (3, 2), (23, 1)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_step_matches_torch_for_gqa_ratios(
    group: int, head_dim: int, dtype: torch.dtype
) -> None:
    check_step(MIXED_STEP, heads=2 * group, kv_heads=2, head_dim=head_dim, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_decode_contexts_split_across_many_blocks(dtype: torch.dtype) -> None:
    # 700 tokens: 44 blocks of 16 and several K splits; the 5-token context in the same launch
    # leaves most of its splits empty.
    assert decode_attention.num_splits(700) > 1
    check_step(
        [(699, 1), (4, 1), (300, 1)], heads=8, kv_heads=2, head_dim=64, dtype=dtype, block_size=16
    )


def test_long_prefill_over_long_cached_context() -> None:
    # A chunk of 70 tokens after 200 cached ones spans several query tiles and key tiles.
    check_step([(200, 70), (0, 33)], heads=4, kv_heads=2, head_dim=64, dtype=torch.float32)


def test_decode_only_and_prefill_only_steps() -> None:
    check_step([(0, 1), (9, 1), (31, 1)], heads=4, kv_heads=1, head_dim=64, dtype=torch.float32)
    check_step([(0, 16), (16, 16)], heads=4, kv_heads=1, head_dim=64, dtype=torch.float32)


def test_store_kv_only_touches_the_mapped_slots() -> None:
    # Block size 1: every token lands in its own block; the rest of the cache stays NaN.
    check_step(
        [(0, 3), (2, 1)], heads=2, kv_heads=2, head_dim=64, dtype=torch.bfloat16, block_size=1
    )


def test_short_block_table_is_rejected_with_the_chunk_named() -> None:
    cache = make_cache(2, 64, torch.float32, block_size=8)
    with pytest.raises(ValueError, match="expected at least 2 blocks"):
        TRITON.build_attention_metadata(
            [4], [10], [[3]], cache=cache, queries_per_kv=1, device=DEVICE
        )


def row_inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_and_fused_residual_add(hidden: int, dtype: torch.dtype) -> None:
    x, residual = row_inputs((5, hidden), dtype, 1), row_inputs((5, hidden), dtype, 2)
    weight = row_inputs((hidden,), dtype, 3)
    eps = 1e-6
    torch.testing.assert_close(
        TRITON.rms_norm(x, weight, eps), TORCH.rms_norm(x, weight, eps), **TOLERANCE[dtype]
    )
    normed, summed = fused_add_rms_norm(x, residual, weight, eps)
    torch.testing.assert_close(summed, x + residual, **TOLERANCE[dtype])
    torch.testing.assert_close(
        normed, TORCH.rms_norm(x + residual, weight, eps), **TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_per_head_of_a_strided_view(dtype: torch.dtype) -> None:
    qkv = row_inputs((3, 7 * 64), dtype, 4)
    qk = qkv[:, : 6 * 64].view(3, 6, 64)  # 4 query + 2 key heads; v's columns are skipped
    weight = row_inputs((6, 64), dtype, 5)
    torch.testing.assert_close(
        TRITON.rms_norm_per_head(qk, weight, 1e-6),
        TORCH.rms_norm_per_head(qk, weight, 1e-6),
        **TOLERANCE[dtype],
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_embedding(head_dim: int, dtype: torch.dtype) -> None:
    positions = torch.tensor([0, 1, 7, 8, 300], device=DEVICE)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=DEVICE).float() / head_dim))
    cos, sin = TORCH.rotary_cos_sin(positions, inv_freq, dtype)
    qkv = row_inputs((5, 9, head_dim), dtype, 6)
    qk = qkv[:, :6]  # rotary runs on a view that skips v
    torch.testing.assert_close(
        TRITON.apply_rotary(qk, cos, sin), TORCH.apply_rotary(qk, cos, sin), **TOLERANCE[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [96, 1500])  # 1500: two column tiles, the second partial
def test_silu_and_mul(width: int, dtype: torch.dtype) -> None:
    gate_up = row_inputs((4, 2 * width), dtype, 7)
    torch.testing.assert_close(
        TRITON.silu_and_mul(gate_up), TORCH.silu_and_mul(gate_up), **TOLERANCE[dtype]
    )


def test_empty_batches_pass_through() -> None:
    empty = torch.empty(0, 64, device=DEVICE)
    assert TRITON.rms_norm(empty, torch.ones(64, device=DEVICE), 1e-6).shape == (0, 64)
    assert TRITON.silu_and_mul(torch.empty(0, 128, device=DEVICE)).shape == (0, 64)


@pytest.mark.skipif(ON_GPU, reason="checks the CPU's refusal")
def test_triton_on_cpu_without_interpreter_fails_naming_what_works(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(
        ValueError, match=r"kernel backend 'triton'.*CUDA.*TRITON_INTERPRET=1.*'torch'"
    ):
        select_backend(CPU, "triton")


# On a GPU the torch backend (SDPA) is checked against HF too: it is the default there.
@pytest.mark.parametrize("backend", ["triton", *(["torch"] if ON_GPU else [])])
def test_demo_sized_model_matches_hf_greedy(backend: str) -> None:
    from engine.demo.default_model import DEFAULT_MODEL_SPEC
    from engine.model.runner import ModelRunner
    from tests.checkpoints import assert_same_greedy, greedy_generate, hf_greedy, tiny_checkpoint

    spec = dataclasses.asdict(DEFAULT_MODEL_SPEC)
    path = tiny_checkpoint(**spec)
    runner = ModelRunner(
        str(path),
        device=DEVICE_NAME,
        dtype="float32",
        kv_cache_memory=4 << 20,
        block_size=16,
        kernel_backend=backend,
    )
    assert runner.backend.name == backend
    generator = torch.Generator().manual_seed(0)
    vocab = spec["vocab_size"]
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in (1, 17, 30)]
    ours = greedy_generate(runner, prompts, 6, chunk_size=12)
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert_same_greedy(tokens, hf_greedy(path, prompt, 6))
