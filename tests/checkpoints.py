"""Shared test helpers: tiny random checkpoints (built once, cached in /tmp), a greedy driver
that runs ModelRunner.forward the way a scheduler would, and Hugging Face reference outputs.

    path = tiny_checkpoint("llama", tie_word_embeddings=True)
    ours = greedy_generate(runner, prompts, max_new_tokens=8, chunk_size=5)
    theirs = hf_greedy(path, prompt, max_new_tokens=8)
    assert_same_greedy(ours[0], theirs)

Checkpoints are keyed by a hash of their spec and of the maker's code and corpus, so a changed
maker rebuilds them; concurrent test processes build in a temporary directory and rename.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from engine.demo.checkpoint_maker import CheckpointSpec, make_checkpoint
from engine.messages.params import LoRARequest
from engine.model.step_inputs import SeqChunk
from engine.settings.home import build_directory

CACHE_ROOT = Path(os.environ.get("ENGINE_TEST_CHECKPOINTS", "/tmp/engine-test-checkpoints"))
TINY = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
}
TIE_TOLERANCE = 1e-4  # HF top-2 logits closer than this: either token is a correct greedy pick


def tiny_checkpoint(arch: str = "qwen3", **overrides: Any) -> Path:
    """A tiny random checkpoint of `arch`, built on first use and cached across test runs."""
    spec = CheckpointSpec(arch=arch, **{**TINY, **overrides})
    key = hashlib.sha256(
        (json.dumps(dataclasses.asdict(spec), sort_keys=True) + _maker_fingerprint()).encode()
    ).hexdigest()[:16]
    target = CACHE_ROOT / f"{arch}-{key}"
    if (target / "config.json").is_file():
        return target
    build_directory(target, lambda staging: make_checkpoint(staging, spec), "config.json")
    return target


@functools.cache
def _maker_fingerprint() -> str:
    import engine.demo.checkpoint_maker as maker
    import engine.demo.tokenizer_maker as tokenizer_maker

    digest = hashlib.sha256()
    for path in (
        Path(maker.__file__),
        Path(tokenizer_maker.__file__),
        tokenizer_maker.DEFAULT_CORPUS,
    ):
        digest.update(path.read_bytes())
    return digest.hexdigest()


class BlockAllocator:
    """The simplest allocator a test needs: hand out free block ids, take them back."""

    def __init__(self, num_blocks: int) -> None:
        self.free = list(range(num_blocks - 1, -1, -1))

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {count}, {len(self.free)} free")
        return [self.free.pop() for _ in range(count)]


@dataclasses.dataclass
class _Sequence:
    seq_id: int
    tokens: list[int]  # prompt + generated
    prompt_len: int
    computed: int  # tokens whose K/V are in the cache
    block_table: list[int]
    generated: list[int] = dataclasses.field(default_factory=list)


def greedy_generate(
    runner: Any,
    prompts: Sequence[list[int]],
    max_new_tokens: int,
    *,
    chunk_size: int | None = None,
    allocator: BlockAllocator | None = None,
    cached_prefixes: Sequence[tuple[int, list[int]] | None] | None = None,
    loras: Sequence[LoRARequest | None] | None = None,
) -> list[list[int]]:
    """Greedy tokens for every prompt, all sequences batched in each step.

    chunk_size: at most this many prompt tokens per sequence per step (chunked prefill), so steps
    mix prefill chunks of some sequences with decode tokens of others.
    cached_prefixes[i]: (tokens already in the cache, their blocks) for prompt i: its first
    chunk starts after them, reading K/V another sequence wrote (a prefix-cache hit).
    loras[i]: the LoRA adapter prompt i runs with (None: the base model).
    """
    allocator = allocator or BlockAllocator(runner.num_blocks)
    block_size = runner.block_size
    seqs = []
    for i, prompt in enumerate(prompts):
        prefix = cached_prefixes[i] if cached_prefixes else None
        computed, table = (prefix[0], list(prefix[1])) if prefix else (0, [])
        needed = -(-(len(prompt) + max_new_tokens) // block_size) - len(table)
        seqs.append(
            _Sequence(i, list(prompt), len(prompt), computed, table + allocator.allocate(needed))
        )
    while any(len(s.generated) < max_new_tokens for s in seqs):
        chunks = []
        running = [s for s in seqs if len(s.generated) < max_new_tokens]
        for s in running:
            end = len(s.tokens)
            if chunk_size is not None:
                end = min(end, s.computed + chunk_size)
            chunks.append(
                SeqChunk(
                    s.seq_id,
                    s.tokens[s.computed : end],
                    s.computed,
                    s.block_table,
                    end == len(s.tokens),
                    lora=loras[s.seq_id] if loras else None,
                )
            )
        logits = runner.forward(chunks)
        next_tokens = iter(logits.argmax(-1).tolist())
        for s, chunk in zip(running, chunks, strict=True):
            s.computed += len(chunk.token_ids)
            if chunk.sample:
                token = next(next_tokens)
                s.generated.append(token)
                s.tokens.append(token)
    return [s.generated for s in seqs]


@functools.cache
def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_greedy(
    path: Path, prompt: list[int], max_new_tokens: int, dtype: torch.dtype = torch.float32
) -> tuple[list[int], torch.Tensor]:
    """transformers' generate(do_sample=False): (tokens, float32 logits [steps, vocab]). Stops
    early at an eos id, as HF does."""
    return generate_greedy(hf_model(path, dtype), prompt, max_new_tokens)


def generate_greedy(
    model: Any, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """`model.generate(do_sample=False)` (a transformers model, or a peft one around it):
    (tokens, float32 logits [steps, vocab])."""
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, torch.stack([step[0] for step in out.logits]).float()


def hf_logits(path: Path, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [tokens, vocab] of one full forward pass."""
    with torch.inference_mode():
        return hf_model(path)(torch.tensor([token_ids])).logits[0].float()


def assert_same_greedy(ours: list[int], reference: tuple[list[int], torch.Tensor]) -> None:
    """Our greedy tokens equal HF's up to HF's length; a divergence is allowed only where HF's
    top-2 logits tie within TIE_TOLERANCE (after that the sequences legitimately differ)."""
    tokens, logits = reference
    for step, (mine, theirs) in enumerate(zip(ours, tokens, strict=False)):
        if mine == theirs:
            continue
        top2 = logits[step].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < TIE_TOLERANCE, (
            f"greedy tokens diverge at step {step}: ours {ours[: step + 1]}, "
            f"HF {tokens[: step + 1]} (HF top-2 gap {gap:.2e} is no tie)"
        )
        return
    assert len(ours) >= len(tokens), f"ours has {len(ours)} tokens, HF {len(tokens)}"
