"""ModelRunner against Hugging Face transformers on the same tiny random checkpoints: greedy
tokens across batching, chunked prefill and prefix-cache hits, and logits within tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.runner import ModelRunner
from engine.model.step_inputs import SeqChunk
from tests.checkpoints import (
    BlockAllocator,
    assert_same_greedy,
    greedy_generate,
    hf_greedy,
    hf_logits,
    tiny_checkpoint,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # short, so scaling bends frequencies these prompts use
}
VARIANTS = {
    "llama-llama3-rope-gqa-untied": {"arch": "llama", "rope_scaling": LLAMA3_ROPE},
    "llama-linear-rope-bias-mha-tied": {
        "arch": "llama",
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "attention_bias": True,
        "num_kv_heads": 4,
        "tie_word_embeddings": True,
    },
    "qwen2-qkv-bias-tied": {"arch": "qwen2", "tie_word_embeddings": True},
    "qwen3-qk-norm-gqa-untied": {"arch": "qwen3", "num_kv_heads": 1},
}
PROMPT_LENGTHS = [1, 6, 16, 17, 40]
NEW_TOKENS = 10


def prompts(lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def model(request: pytest.FixtureRequest) -> tuple[Path, ModelRunner]:
    path = tiny_checkpoint(**VARIANTS[request.param])
    return path, ModelRunner(str(path), kv_cache_memory=4 << 20, block_size=16)


def test_batched_prompts_of_mixed_lengths_match_hf_greedy(
    model: tuple[Path, ModelRunner],
) -> None:
    path, runner = model
    batch = prompts(PROMPT_LENGTHS)
    ours = greedy_generate(runner, batch, NEW_TOKENS)
    for prompt, tokens in zip(batch, ours, strict=True):
        assert_same_greedy(tokens, hf_greedy(path, prompt, NEW_TOKENS))


def test_chunked_prefill_mixed_with_decodes_matches_hf_greedy(
    model: tuple[Path, ModelRunner],
) -> None:
    path, runner = model
    batch = prompts(PROMPT_LENGTHS, seed=1)
    ours = greedy_generate(runner, batch, NEW_TOKENS, chunk_size=5)
    for prompt, tokens in zip(batch, ours, strict=True):
        assert_same_greedy(tokens, hf_greedy(path, prompt, NEW_TOKENS))


def test_prefix_blocks_written_by_another_sequence_are_reused(
    model: tuple[Path, ModelRunner],
) -> None:
    path, runner = model
    allocator = BlockAllocator(runner.num_blocks)
    shared = prompts([32], seed=2)[0]  # two full blocks of 16
    first = shared + prompts([9], seed=3)[0]
    greedy_generate(runner, [first], 2, allocator=allocator)  # writes blocks 0 and 1 first
    prefix_blocks = [0, 1]
    later = [shared + tail for tail in prompts([1, 7, 20], seed=4)]
    ours = greedy_generate(
        runner,
        later,
        NEW_TOKENS,
        allocator=allocator,
        chunk_size=8,
        cached_prefixes=[(32, prefix_blocks)] * len(later),
    )
    for prompt, tokens in zip(later, ours, strict=True):
        assert_same_greedy(tokens, hf_greedy(path, prompt, NEW_TOKENS))


def test_logits_of_every_chunk_end_are_close_to_hf(model: tuple[Path, ModelRunner]) -> None:
    path, runner = model
    tokens = prompts([37], seed=5)[0]
    table = BlockAllocator(runner.num_blocks).allocate(3)
    ends = [7, 8, 20, 21, 37]  # chunks of 7, 1, 12, 1 and 16 tokens
    starts = [0, *ends[:-1]]
    chunks = [SeqChunk(0, tokens[s:e], s, table, True) for s, e in zip(starts, ends, strict=True)]
    reference = hf_logits(path, tokens)
    for chunk, end in zip(chunks, ends, strict=True):
        ours = runner.forward([chunk])
        assert ours.dtype == torch.float32 and ours.shape == (1, runner.config.vocab_size)
        torch.testing.assert_close(ours[0], reference[end - 1], atol=1e-4, rtol=1e-4)
