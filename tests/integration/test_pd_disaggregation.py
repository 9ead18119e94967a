"""One-launch P/D disaggregation with real processes: a prefill replica and a decode replica,
each with its kv_transfer actors, behind one gateway.

Every request is prefilled on the prefill replica, whose first token the client gets from
there; its prompt KV then moves to the decode replica, which continues the stream. Greedy
outputs must equal transformers' on the same checkpoint for each architecture, and the second
round of prompts sharing the first round's prefixes must find those blocks in the decode side's
prefix cache (pulled only once).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator

import pytest

from engine import LLM, SamplingParams
from engine.launch.pd_plan import kv_layout
from engine.messages.admin import EngineStats, ReplicaRow
from engine.model.config import load_model_config
from tests.checkpoints import tiny_checkpoint
from tests.hf_reference import assert_greedy_matches_hf
from tests.integration.test_llm_matches_hf import ARCHS

BLOCK = 16
MAX_TOKENS = 10
SETTLE_S = 10.0
# One prefill and one decode replica, small steps and a small cache: every test's launch.
PD_ENGINE = {
    "kv_cache_memory": 4 * 2**20,
    "kv_transfer__prefill_replicas": 1,
    "kv_transfer__decode_replicas": 1,
    "scheduler__max_num_batched_tokens": 64,
    "scheduler__max_num_seqs": 8,
}


@pytest.fixture(scope="module", params=list(ARCHS))
def model_path(request: pytest.FixtureRequest) -> str:
    return str(tiny_checkpoint(**ARCHS[request.param]))


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[LLM]:
    with LLM(model_path, **PD_ENGINE) as engine:
        yield engine


def replica(stats: EngineStats, role: str) -> ReplicaRow:
    (row,) = [row for row in stats.replicas if row.role == role]
    return row


def settled_stats(llm: LLM, done: Callable[[EngineStats], bool]) -> EngineStats:
    """The engine's figures once `done` holds of them: the schedulers' reports reach the root a
    moment after the outputs they count (every wait has its timeout)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        stats = llm.stats()
        if done(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def test_greedy_outputs_through_prefill_and_decode_replicas_match_transformers(
    llm: LLM, model_path: str
) -> None:
    rng = random.Random(3)
    # One prompt shorter than a block (nothing to move: the decode side computes it), the
    # others spanning several blocks with a partial last one.
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 40, 65, 33)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        [completion] = out.outputs
        assert len(completion.token_ids) == MAX_TOKENS and completion.finish_reason == "length"
        assert_greedy_matches_hf(model_path, prompt, completion.token_ids)
    moving = sum(1 for p in prompts if len(p) >= BLOCK)
    stats = settled_stats(
        llm,
        lambda s: replica(s, "decode").kv_pulls >= moving and replica(s, "prefill").kv_holds == 0,
    )
    prefill, decode = replica(stats, "prefill"), replica(stats, "decode")
    assert prefill.kv_handoffs == len(prompts)
    full_blocks = sum(len(p) // BLOCK for p in prompts)
    assert decode.kv_blocks_pulled == full_blocks
    assert decode.kv_pulls == moving
    assert decode.kv_bytes_pulled > 0 and decode.kv_fallbacks == 0
    # Each hold ended with the puller's acknowledgement, none by its timeout.
    assert prefill.kv_holds == 0 and prefill.kv_holds_expired == 0


def test_prompts_sharing_a_pulled_prefix_find_it_in_the_decode_side_prefix_cache(
    llm: LLM, model_path: str
) -> None:
    rng = random.Random(7)
    shared = [rng.randrange(3, 200) for _ in range(3 * BLOCK)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    first = shared + [rng.randrange(3, 200) for _ in range(5)]
    pulls = replica(llm.stats(), "decode").kv_pulls
    llm.generate([first], params)
    before = replica(settled_stats(llm, lambda s: replica(s, "decode").kv_pulls > pulls), "decode")
    second = shared + [rng.randrange(3, 200) for _ in range(20)]
    [out] = llm.generate([second], params)
    assert_greedy_matches_hf(model_path, second, out.outputs[0].token_ids)
    after = replica(
        settled_stats(llm, lambda s: replica(s, "decode").kv_pulls > before.kv_pulls), "decode"
    )
    # The shared three blocks were already there; only the fourth (of 68 tokens) moved.
    assert after.kv_blocks_from_cache - before.kv_blocks_from_cache == 3
    assert after.kv_blocks_pulled - before.kv_blocks_pulled == 1


def test_with_two_tensor_parallel_ranks_each_rank_moves_its_shard() -> None:
    path = str(tiny_checkpoint(arch="llama"))
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (40, 70)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(path, tensor_parallel_size=2, **PD_ENGINE) as llm:
        outputs = llm.generate(prompts, params)
        for prompt, out in zip(prompts, outputs, strict=True):
            assert_greedy_matches_hf(path, prompt, out.outputs[0].token_ids)
        stats = settled_stats(llm, lambda s: replica(s, "decode").kv_pulls >= len(prompts))
    decode = replica(stats, "decode")
    assert decode.kv_pulls == len(prompts) and decode.kv_fallbacks == 0
    assert decode.kv_blocks_pulled == sum(len(p) // BLOCK for p in prompts)
    # Both ranks pulled every block, each its own heads' share of the bytes.
    config = load_model_config(path)
    rank_block = kv_layout(config, "float32", BLOCK, 1, 2, 0).block_bytes
    assert decode.kv_bytes_pulled == 2 * rank_block * decode.kv_blocks_pulled
