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
from collections.abc import Iterator

import pytest

from engine import LLM, SamplingParams
from engine.messages.admin import EngineStats, ReplicaRow
from tests.checkpoints import tiny_checkpoint
from tests.hf_reference import assert_greedy_matches_hf

ARCHS = {
    "llama": {"arch": "llama"},
    "qwen2": {"arch": "qwen2"},
    "qwen3-tied": {"arch": "qwen3", "tie_word_embeddings": True},
}
BLOCK = 16
MAX_TOKENS = 10


@pytest.fixture(scope="module", params=list(ARCHS))
def model_path(request: pytest.FixtureRequest) -> str:
    return str(tiny_checkpoint(**ARCHS[request.param]))


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[LLM]:
    with LLM(
        model_path,
        kv_cache_memory=4 * 2**20,
        kv_transfer__prefill_replicas=1,
        kv_transfer__decode_replicas=1,
        scheduler__max_num_batched_tokens=64,
    ) as engine:
        yield engine


def replica(stats: EngineStats, role: str) -> ReplicaRow:
    (row,) = [row for row in stats.replicas if row.role == role]
    return row


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
    stats = llm.stats()
    prefill, decode = replica(stats, "prefill"), replica(stats, "decode")
    assert prefill.kv_handoffs == len(prompts)
    full_blocks = sum(len(p) // BLOCK for p in prompts)
    assert decode.kv_blocks_pulled == full_blocks  # every rank's blocks: one rank here
    assert decode.kv_pulls == sum(1 for p in prompts if len(p) >= BLOCK)
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
    llm.generate([first], params)
    before = replica(llm.stats(), "decode")
    second = shared + [rng.randrange(3, 200) for _ in range(20)]
    [out] = llm.generate([second], params)
    assert_greedy_matches_hf(model_path, second, out.outputs[0].token_ids)
    after = replica(llm.stats(), "decode")
    # The shared three blocks were already there; only the fourth (of 68 tokens) moved.
    assert after.kv_blocks_from_cache - before.kv_blocks_from_cache == 3
    assert after.kv_blocks_pulled - before.kv_blocks_pulled == 1
