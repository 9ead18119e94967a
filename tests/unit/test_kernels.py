"""The CPU paged-attention backends (torch's, and the compiled one: engine/kernels/cpu) against
plain per-sequence causal attention."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import attention_metadata
from engine.kernels.attention_metadata import SlotRows, TableRows, build_attention_metadata
from engine.kernels.cpu.attention import store_kv
from engine.kernels.kv_cache import PagedKVCache
from engine.kernels.registry import select_backend
from engine.kernels.torch_ops import apply_rotary, output_projection, rms_norm

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 8, 4
# The compiled kernel has register-blocked code for head sizes 64 and 128, a plain loop else.
BACKENDS = ["torch", "cpu"]


def make_cache(
    num_blocks: int = 512,
    kv_heads: int = KV_HEADS,
    dtype: torch.dtype = torch.float32,
    head_dim: int = HEAD_DIM,
) -> PagedKVCache:
    cache = PagedKVCache(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=BLOCK,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    # Unwritten slots hold NaN: any read of one that is not masked away poisons the output (an
    # int8 row of all-ones bytes has the scale NaN).
    unwritten = cache.storage[:, :, : cache.null_slot]
    if dtype == torch.int8:
        unwritten.fill_(-1)
    else:
        unwritten.fill_(float("nan"))
    return cache


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
) -> torch.Tensor:
    """q [n, heads, d] at positions start.., k/v [start + n, kv_heads, d]: causal attention,
    in float32."""
    q, k, v = q.float(), k.float(), v.float()
    scale = q.shape[-1] ** -0.5
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    query_pos = torch.arange(start, start + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(q.shape[0], -1)


def run_step(
    chunks: list[tuple[int, int]],
    seed: int = 0,
    heads: int = HEADS,
    kv_heads: int = KV_HEADS,
    dtype: torch.dtype = torch.float32,
    tolerance: float = 1e-5,
    backend: str = "torch",
    head_dim: int = HEAD_DIM,
    cache_dtype: torch.dtype | None = None,
) -> None:
    """chunks: (start_pos, query_len) per sequence. Prefixes are written to scattered blocks
    (a random permutation of the cache) first, then one step runs all chunks together through
    `backend`; each output must equal the reference. A `cache_dtype` other than `dtype`: the
    reference attends to the K/V as the cache holds them (the chunks must read their own K/V
    from the cache: none may start at 0 but decodes)."""
    kernels = select_backend("cpu", backend)
    generator = torch.Generator().manual_seed(seed)
    cache = make_cache(kv_heads=kv_heads, dtype=cache_dtype or dtype, head_dim=head_dim)
    blocks = torch.randperm(cache.num_blocks, generator=generator).tolist()
    tables, histories, queries = [], [], []
    for start, length in chunks:
        total = start + length
        table = [blocks.pop() for _ in range(-(-total // BLOCK))]
        k = torch.randn(total, kv_heads, head_dim, generator=generator).to(dtype)
        v = torch.randn(total, kv_heads, head_dim, generator=generator).to(dtype)
        if start:
            slots = torch.tensor([table[p // BLOCK] * BLOCK + p % BLOCK for p in range(start)])
            cache.write(0, slots, k[:start], v[:start])
        tables.append(table)
        histories.append((k, v))
        queries.append(torch.randn(length, heads, head_dim, generator=generator).to(dtype))
    meta = kernels.build_attention_metadata(
        [n for _, n in chunks],
        [s for s, _ in chunks],
        tables,
        cache=cache,
        queries_per_kv=heads // kv_heads,
        device=torch.device("cpu"),
    )
    new_k = torch.cat([k[s:] for (s, _), (k, _) in zip(chunks, histories, strict=True)])
    new_v = torch.cat([v[s:] for (s, _), (_, v) in zip(chunks, histories, strict=True)])
    queries_in_step = torch.cat(queries)
    out = kernels.paged_attention(queries_in_step, new_k, new_v, cache, 0, meta, head_dim**-0.5)
    assert torch.isfinite(out).all()
    row = 0
    for (start, length), q, (k, v) in zip(chunks, queries, histories, strict=True):
        if cache_dtype is not None:
            k, v = (cache.decode(cache.encode(x), torch.float32) for x in (k, v))
        expected = reference_attention(q, k, v, start)
        torch.testing.assert_close(
            out[row : row + length].float(), expected, atol=tolerance, rtol=tolerance
        )
        row += length


@pytest.mark.parametrize(
    "chunks",
    [
        [(0, 1)],
        [(7, 1), (0, 1), (12, 1), (3, 1)],  # decode only, different context lengths
        [(0, 9)],  # one fresh prefill: plain causal attention on its own K/V
        [(0, 9), (0, 3), (0, 16)],  # several short prefills
        [(10, 6), (5, 1)],  # a chunk after cached tokens (chunked prefill / prefix hit) + decode
        [(0, 5), (9, 1), (4, 7), (0, 1), (13, 2), (30, 1)],  # everything in one step
        [(300, 1), (5, 1), (700, 1), (20, 1)],  # decode contexts of very different lengths
        [(0, 5), (3, 7), (10, 40), (2, 1), (0, 50)],  # short chunks in place, long ones alone
        [(3, 1), (4, 1), (7, 2), (8, 1), (15, 1), (16, 1), (11, 6)],  # around block boundaries
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_equals_per_sequence_causal_attention(
    chunks: list[tuple[int, int]], backend: str
) -> None:
    run_step(chunks, backend=backend)


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (8, 2), (6, 1)])
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize(("backend", "head_dim"), [("torch", 8), ("cpu", 8), ("cpu", 64)])
def test_in_place_attention_over_shuffled_blocks_for_each_gqa_ratio(
    heads: int, kv_heads: int, seed: int, backend: str, head_dim: int
) -> None:
    generator = torch.Generator().manual_seed(seed)
    chunks = []
    for _ in range(12):  # decodes and short prefill chunks, starts across block boundaries
        start = int(torch.randint(0, 60, (), generator=generator))
        length = (
            1
            if torch.rand((), generator=generator) < 0.6
            else int(torch.randint(2, 20, (), generator=generator))
        )
        chunks.append((start, length))
    run_step(chunks, seed, heads, kv_heads, backend=backend, head_dim=head_dim)


def test_decodes_and_short_chunks_attend_in_place_together() -> None:
    cache = make_cache(64)

    def step_metadata(in_place: attention_metadata.InPlace) -> attention_metadata.AttentionMetadata:
        return build_attention_metadata(
            [1, 5, 40, 1],
            [9, 3, 0, 17],
            [[1, 2, 3], [4, 5], list(range(6, 16)), [20, 21, 22, 23, 24]],
            cache=cache,
            queries_per_kv=2,
            device=torch.device("cpu"),
            in_place=in_place,
        )

    meta = step_metadata("sparse")
    in_place = [p for p in meta.pieces if isinstance(p, SlotRows)]
    assert len(in_place) == 1
    assert in_place[0].rows.tolist() == [0, 1, 2, 3, 4, 5, 46]  # the 40-token chunk is apart
    # one pattern row per (token, query head), listing exactly the keys that token sees
    seen = [10, 4, 5, 6, 7, 8, 18]
    assert in_place[0].pattern.crow_indices().diff().tolist() == [
        n for n in seen for _ in range(HEADS)
    ]
    # The compiled kernel's piece: the same tokens, each with its block table and count.
    tables = [p for p in step_metadata("table").pieces if isinstance(p, TableRows)]
    assert len(tables) == 1 and tables[0].rows is not None
    assert tables[0].rows.tolist() == [0, 1, 2, 3, 4, 5, 46]
    assert tables[0].seen.tolist() == seen
    assert tables[0].token_chunk.tolist() == [0, 1, 1, 1, 1, 1, 2]
    contexts = [10, 8, 18]  # per short chunk: the blocks it reads are the first of its table
    rows = tables[0].tables.tolist()
    assert [row[: -(-n // BLOCK)] for row, n in zip(rows, contexts, strict=True)] == [
        [1, 2, 3],
        [4, 5],
        [20, 21, 22, 23, 24],
    ]


@pytest.mark.parametrize(
    ("backend", "dtype", "head_dim"),
    [
        ("torch", torch.bfloat16, 8),
        ("cpu", torch.bfloat16, 8),
        ("cpu", torch.bfloat16, 128),
        ("cpu", torch.float16, 64),
    ],
)
def test_half_precision_cache_attends_like_float32(
    backend: str, dtype: torch.dtype, head_dim: int
) -> None:
    chunks = [(0, 5), (9, 1), (4, 7), (30, 1)]
    run_step(chunks, dtype=dtype, tolerance=3e-2, backend=backend, head_dim=head_dim)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16, torch.int8])
@pytest.mark.parametrize(
    ("backend", "head_dim"), [("torch", 8), ("batch_invariant", 8), ("cpu", 8), ("cpu", 64)]
)
def test_a_compact_cache_attends_to_the_values_it_stores(
    cache_dtype: torch.dtype, backend: str, head_dim: int
) -> None:
    """float32 queries against a 16-bit or int8 cache: each backend reads back what the cache
    stores (cache.decode of cache.encode) and computes in float32 from there; a long chunk after
    cached tokens goes through the gathering path of each."""
    chunks = [(7, 1), (10, 6), (300, 1), (3, 1), (20, 40)]
    run_step(chunks, backend=backend, head_dim=head_dim, cache_dtype=cache_dtype)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8])
def test_the_kernels_cache_writes_store_what_torch_stores(cache_dtype: torch.dtype) -> None:
    """The compiled backend's writes (kv_store.cpp, which the fused decode step calls too) and
    the cache's torch encoding leave the same bytes: K and V read alike whichever path wrote
    them. int8 rows read back within half a step of their scale."""
    generator = torch.Generator().manual_seed(3)
    slots = torch.tensor([5, 17, 2, 30])
    qkv = torch.randn(4, 3 * KV_HEADS, 64, generator=generator) * 3
    qkv[1, KV_HEADS] = 0.0  # a key row of zeros: scale 0, codes 0
    key, value = qkv[:, KV_HEADS : 2 * KV_HEADS], qkv[:, 2 * KV_HEADS :]  # strided, as in a step
    ours, theirs = (make_cache(8, dtype=cache_dtype, head_dim=64) for _ in range(2))
    store_kv(ours, 0, slots, key, value)
    theirs.write(0, slots, key, value)
    assert torch.equal(ours.storage.view(torch.uint8), theirs.storage.view(torch.uint8))
    if cache_dtype == torch.int8:
        k, _ = ours.gather(0, slots, torch.float32)
        step = key.abs().amax(-1, keepdim=True) / 127
        assert ((k - key).abs() <= step / 2 * (1 + 1e-6)).all()
        assert torch.equal(k[1, 0], torch.zeros(64))


@pytest.mark.parametrize("backend", BACKENDS)
def test_long_chunks_after_cached_tokens_attend_in_tiles(
    monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    monkeypatch.setattr(attention_metadata, "MASK_BUDGET", 64)  # tiles of 16 query rows
    cache = make_cache(64)
    meta = build_attention_metadata(
        [40], [10], [list(range(13))], cache=cache, queries_per_kv=2, device=torch.device("cpu")
    )
    assert [piece.rows for piece in meta.pieces] == [(0, 16), (16, 32), (32, 40)]
    run_step([(10, 40), (0, 3), (6, 1)], backend=backend)


def test_new_keys_and_values_land_in_their_slots() -> None:
    cache = make_cache(8)
    meta = build_attention_metadata(
        [3], [2], [[5, 1]], cache=cache, queries_per_kv=2, device=torch.device("cpu")
    )
    assert meta.positions.tolist() == [2, 3, 4]
    assert meta.slot_mapping.tolist() == [5 * BLOCK + 2, 5 * BLOCK + 3, 1 * BLOCK + 0]
    key = torch.randn(3, KV_HEADS, HEAD_DIM)
    cache.write(0, meta.slot_mapping, key, -key)
    keys, values = cache.block_view(0)
    assert torch.equal(keys[5, 2:], key[:2]) and torch.equal(keys[1, 0], key[2])
    assert torch.equal(values[1, 0], -key[2])


def test_block_tables_that_do_not_cover_the_chunk_are_rejected() -> None:
    cache = make_cache(8)
    with pytest.raises(ValueError, match="covers 4 tokens but the chunk reaches position 5"):
        build_attention_metadata(
            [3], [3], [[0]], cache=cache, queries_per_kv=2, device=torch.device("cpu")
        )
    with pytest.raises(ValueError, match="block id 8 is out of range; expected 0 <= id < 8"):
        build_attention_metadata(
            [1], [0], [[8]], cache=cache, queries_per_kv=2, device=torch.device("cpu")
        )


def test_rotary_and_rms_norm_match_the_reference_formulas() -> None:
    x = torch.randn(5, 3, HEAD_DIM)
    cos, sin = torch.randn(5, 1, HEAD_DIM // 2), torch.randn(5, 1, HEAD_DIM // 2)
    half = HEAD_DIM // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    expected = x * torch.cat((cos, cos), -1) + rotated * torch.cat((sin, sin), -1)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected)
    weight = torch.randn(HEAD_DIM)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), normed)


def test_output_projection_equals_a_plain_matmul() -> None:
    weight = torch.randn(1000, 64)
    project = output_projection(weight)
    for rows in (1, 7, 64):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(project(x), x @ weight.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_backends_prepared_linear_equals_a_plain_matmul(
    bias: bool, dtype: torch.dtype
) -> None:
    """float32 through the compiled kernel; bfloat16 through F.linear for one token, through the
    weight packed for oneDNN for more: all x @ W.T + b; a weight it was not prepared for goes to
    F.linear."""
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    b = torch.randn(96, generator=generator).to(dtype) if bias else None
    linear = select_backend("cpu", "cpu").prepared_linear(weight)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    for rows in (1, 2, 7, 64):
        x = torch.randn(rows, 64, generator=generator).to(dtype)
        expected = (x.float() @ weight.float().T + (0 if b is None else b.float())).to(dtype)
        got = linear(x, weight, b)
        torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    other = torch.randn(96, 64, generator=generator).to(dtype)
    assert torch.equal(linear(x, other, b), torch.nn.functional.linear(x, other, b))


def test_backend_selection_names_what_it_accepts() -> None:
    # auto on the CPU: the compiled backend (this machine has a C++ compiler; see
    # test_cpu_kernel for a machine without one), torch by name
    assert select_backend("cpu").name == "cpu"
    assert select_backend("cpu", "torch").name == "torch"
    with pytest.raises(ValueError, match="unknown kernel backend 'flashy'"):
        select_backend("cpu", "flashy")
    with pytest.raises(ValueError, match="unsupported device 'meta'"):
        select_backend("meta")
