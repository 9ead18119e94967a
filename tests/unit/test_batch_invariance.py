"""Deterministic mode's kernels (engine/kernels/batch_invariant.py): a sequence's logits are
bit-identical whether it runs alone or batched with 1, 2, 3 or 15 others, prefilled whole, in
chunks, or decoded (issue 17, item 6), for every architecture."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from engine.kernels.batch_invariant import MIN_GEMM_ROWS, linear
from engine.model.runner import ModelRunner
from engine.model.step_inputs import SeqChunk
from tests.checkpoints import tiny_checkpoint

ARCHS = {
    "llama": {"arch": "llama"},
    "qwen2": {"arch": "qwen2"},
    "qwen3": {"arch": "qwen3"},
    "qwen3-tied": {"arch": "qwen3", "tie_word_embeddings": True},
    "qwen2-bfloat16": {"arch": "qwen2"},  # bf16_linear.cpp's one order per row, any path
}
DTYPES = {"qwen2-bfloat16": "bfloat16"}
BLOCK = 16
PROMPT_LEN = 40


class Blocks:
    """Hands out fresh KV blocks, so no scenario reads another's cache."""

    def __init__(self) -> None:
        self._next = itertools.count()

    def table(self, tokens: int) -> list[int]:
        return [next(self._next) for _ in range(-(-tokens // BLOCK))]


@pytest.fixture(scope="module", params=list(ARCHS))
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    path = tiny_checkpoint(**ARCHS[request.param])  # type: ignore[arg-type]
    return ModelRunner(
        str(path),
        dtype=DTYPES.get(request.param, "auto"),
        kv_cache_memory=8 << 20,
        max_model_len=256,
        kernel_backend="batch_invariant",
    )


def test_linear_pads_to_the_rows_where_a_row_computes_alike() -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 48, generator=generator)
    bias = torch.randn(96, generator=generator)
    x = torch.randn(20, 48, generator=generator)
    alone = linear(x[:1], weight, bias)[0]
    for rows in range(1, 21):
        assert torch.equal(linear(x[:rows], weight, bias)[0], alone), rows
    assert torch.equal(alone, F.linear(x[:MIN_GEMM_ROWS], weight, bias)[0])


def test_a_sequences_logits_do_not_depend_on_its_batch_or_its_chunks(runner: ModelRunner) -> None:
    rng = random.Random(0)
    vocab = runner.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(PROMPT_LEN)]
    blocks = Blocks()

    def alone_whole() -> torch.Tensor:
        return runner.forward([SeqChunk(1, prompt, 0, blocks.table(PROMPT_LEN), True)])[0]

    def in_chunks(cuts: list[int]) -> torch.Tensor:
        table = blocks.table(PROMPT_LEN)
        edges = [0, *cuts, PROMPT_LEN]
        for start, stop in itertools.pairwise(edges[:-1]):
            runner.forward([SeqChunk(1, prompt[start:stop], start, table, False)])
        start = edges[-2]
        return runner.forward([SeqChunk(1, prompt[start:], start, table, True)])[0]

    def decoded_beside(others: int, where: int) -> torch.Tensor:
        """The last prompt token decoded in one step with `others` other sequences: decodes of
        other lengths, and one prefill chunk among them."""
        table = blocks.table(PROMPT_LEN)
        runner.forward([SeqChunk(1, prompt[:-1], 0, table, False)])
        batch = []
        for i in range(others):
            length = rng.randrange(1, 60)
            tokens = [rng.randrange(vocab) for _ in range(length)]
            other = blocks.table(length)
            if i == 0:  # a prefill chunk in the same step
                batch.append(SeqChunk(100 + i, tokens, 0, other, True))
                continue
            runner.forward([SeqChunk(100 + i, tokens[:-1], 0, other, False)] if length > 1 else [])
            batch.append(SeqChunk(100 + i, tokens[-1:], length - 1, other, True))
        target = SeqChunk(1, prompt[-1:], PROMPT_LEN - 1, table, True)
        batch.insert(where, target)
        return runner.forward(batch)[where]

    reference = alone_whole()
    cases = {
        "decoded alone": decoded_beside(0, 0),
        "chunks 7/23/10": in_chunks([7, 30]),
        "chunks 16/16/8": in_chunks([16, 32]),
        "chunk of 1 at the end": in_chunks([39]),
    }
    for others, where in [(1, 0), (2, 1), (3, 3), (15, 7)]:
        cases[f"decoded in a batch of {others + 1}"] = decoded_beside(others, where)
    different = [name for name, logits in cases.items() if not torch.equal(logits, reference)]
    assert different == []


@pytest.mark.parametrize("neighbour_context", [10, 17, 40, 100])
def test_attention_does_not_depend_on_the_steps_longest_context(neighbour_context: int) -> None:
    """Keys are padded to the step's longest context: a token's attention must not change by a bit
    whatever its neighbour's context (heads as the default model's: 9 over 3 KV heads of 64)."""
    from engine.kernels import batch_invariant
    from engine.kernels.kv_cache import PagedKVCache

    heads, kv_heads, head_dim, context = 9, 3, 64, 10
    cache = PagedKVCache(
        num_layers=1,
        num_blocks=16,
        block_size=BLOCK,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    generator = torch.Generator().manual_seed(0)
    rows = context + max(neighbour_context, 1)
    inputs = [
        torch.randn(rows, n, head_dim, generator=generator) for n in (heads, kv_heads, kv_heads)
    ]

    def attend(contexts: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Each sequence's whole context as one chunk (so every key is written); the last row of
        the first sequence: its newest token's attention."""
        query, key, value = (tensor[: sum(contexts)] for tensor in inputs)
        meta = batch_invariant.build_attention_metadata(
            contexts,
            [0] * len(contexts),
            tables,
            cache=cache,
            queries_per_kv=heads // kv_heads,
            device=torch.device("cpu"),
        )
        out = batch_invariant.paged_attention(query, key, value, cache, 0, meta, head_dim**-0.5)
        return out[context - 1]

    alone = attend([context], [[0]])
    neighbour_blocks = list(range(1, 1 + -(-neighbour_context // BLOCK)))
    beside = attend([context, neighbour_context], [[0], neighbour_blocks])
    assert torch.equal(beside, alone)
