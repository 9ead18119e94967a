"""The prefix cache's disk tier in a running engine (issue 50), in deterministic mode so that an
answer from disk must equal the cold one token for token: a prompt's blocks come back after other
traffic evicted them from RAM; a block file from another model, a truncated one and a corrupted
one are each dropped and counted, and the answer stays exact (the request computes from that
block on, and the block is written anew). A new engine's empty RAM (a restart, a reload) is
tests/e2e/test_kv_disk_restart.py's.

The cache here is int8, whose rows carry their scales after their codes: a block's file holds
both, and a block read back without its scales would give other tokens. The root killed and
restarted with a 4,000-token prompt (the model's own KV dtype) is tests/e2e/
test_kv_disk_restart.py. Prompts here are 256 tokens: deterministic mode's attention pads every
query to the step's longest context, so its prefill costs grow with the square of the prompt."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.kv.cache.prefix_cache import BlockHashChain
from engine.kv.disk.block_file import HEADER_BYTES
from engine.kv.disk.store import DiskStore
from engine.library.llm import build_settings
from engine.messages.admin import EngineStats
from engine.settings import Settings
from tests.checkpoints import tiny_checkpoint

BLOCK_SIZE = 16
PROMPT = [3 + (i * 7919) % 500 for i in range(256)]  # 16 blocks
OTHER = [3 + (i * 104729 + 11) % 500 for i in range(256)]
REUSABLE = 255 // BLOCK_SIZE * BLOCK_SIZE  # the last token always runs through the model
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# One block of the tiny model's int8 cache: 2 layers x K,V x 16 tokens x 2 KV heads x (16 int8
# codes + a float32 scale).
BLOCK_BYTES = 2 * 2 * BLOCK_SIZE * 2 * (16 + 4)
# 24 blocks: room for one prompt and a half, so the other prompt evicts most of the first's
POOL_BYTES = 24 * BLOCK_BYTES


def settings(tier: Path) -> Settings:
    return build_settings(
        **{
            "model.path": str(tiny_checkpoint(arch="qwen3")),
            "model.max_model_len": 300,
            "model.deterministic": True,
            "cache.kv_cache_memory": POOL_BYTES,
            "cache.kv_cache_dtype": "int8",
            "cache.kv_disk_path": str(tier),
            "scheduler.max_num_batched_tokens": 256,
        }
    )


@pytest.fixture
def llm(tmp_path: Path) -> Iterator[LLM]:
    engine = LLM(str(tiny_checkpoint(arch="qwen3")), settings=settings(tmp_path))
    yield engine
    engine.close()


def serve(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    """The greedy answer and the prompt tokens that came from a cache, once the engine's figures
    count the request whole (the scheduler's report reaches the root a moment after the
    outputs) and every block it indexed is on disk."""
    steps = llm.stats().num_steps
    [out] = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)
    deadline = time.monotonic() + 60
    while not settled(llm.stats(), steps) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert settled(llm.stats(), steps)
    return list(out.outputs[0].token_ids), int(out.num_cached_tokens or 0)


def settled(stats: EngineStats, steps_before: int) -> bool:
    """A report from after the request ended (it ran steps and nothing runs now), with nothing
    left to write."""
    return (
        stats.num_steps > steps_before
        and stats.num_requests == 0
        and stats.kv_disk_unwritten_blocks == 0
    )


def block_file(namespace: Path, index: int) -> Path:
    return namespace / f"{BlockHashChain(BLOCK_SIZE).key(PROMPT, index).hex()}.kv"


def test_blocks_come_back_after_ram_eviction_and_bad_files_are_dropped(
    llm: LLM, tmp_path: Path
) -> None:
    cold, cached = serve(llm, PROMPT)
    assert cached == 0
    assert llm.stats().kv_disk_written_blocks == 16  # the last token's KV came with decoding
    (ours,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    assert block_file(ours, 0).stat().st_size == HEADER_BYTES + BLOCK_BYTES  # scales included
    # The other prompt takes 17 of the 24 blocks: PROMPT keeps its first 7 in RAM, and its 8
    # other reusable ones (of 15: the last block holds the last token) come from disk.
    serve(llm, OTHER)
    assert serve(llm, PROMPT) == (cold, REUSABLE)
    assert llm.stats().kv_disk_hit_blocks == 15 - 7

    # Another model's block file of the same prefix, put under this model's name for it.
    theirs = DiskStore(str(tmp_path), b"another model..!", 1 << 40)
    key = BlockHashChain(BLOCK_SIZE).key(PROMPT, 8)
    theirs.write(key, [memoryview(bytes(BLOCK_BYTES))])
    Path(theirs.path(key)).replace(block_file(ours, 8))
    truncated = block_file(ours, 11)
    truncated.write_bytes(truncated.read_bytes()[:-100])
    corrupted = block_file(ours, 13)
    data = bytearray(corrupted.read_bytes())
    data[HEADER_BYTES + BLOCK_BYTES - 1] ^= 1  # in the last row's scale
    corrupted.write_bytes(bytes(data))
    for bad in (8, 11, 13):  # each read after the other prompt evicted it from RAM
        serve(llm, OTHER)
        assert serve(llm, PROMPT) == (cold, bad * BLOCK_SIZE)
    serve(llm, OTHER)
    assert serve(llm, PROMPT) == (cold, REUSABLE)  # the dropped blocks were written anew
    assert llm.stats().kv_disk_dropped_blocks == 3
