"""The whole actor system (tokenizer, scheduler, worker, detokenizer processes) against HF.

Greedy tokens must equal transformers' on the same checkpoint: batched prompts of mixed lengths,
small prefill chunks, prefix-cache hits, preemption forced by a tiny KV cache; logprobs must
match transformers' log-softmax.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from engine import LLM, SamplingParams
from engine.messages.admin import EngineStats
from tests.checkpoints import tiny_checkpoint
from tests.hf_reference import assert_greedy_matches_hf, hf_embedding, hf_log_softmax

ARCHS = {
    "llama": {"arch": "llama"},
    "qwen2": {"arch": "qwen2"},
    "qwen3-tied": {"arch": "qwen3", "tie_word_embeddings": True},
}


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=list(ARCHS))
def model_path(request: pytest.FixtureRequest) -> str:
    return str(tiny_checkpoint(**ARCHS[request.param]))


@pytest.fixture(scope="module")
def llm(model_path: str) -> Iterator[LLM]:
    # Small steps force chunked prefill; a small KV cache keeps the test light.
    with LLM(
        model_path,
        kv_cache_memory=4 * 2**20,
        scheduler__max_num_batched_tokens=32,
        scheduler__max_num_seqs=8,
    ) as engine:
        yield engine


def test_greedy_batch_of_mixed_lengths_matches_transformers(llm: LLM, model_path: str) -> None:
    prompts = _prompts(200, [3, 17, 40, 65, 9])
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [out.prompt_token_ids for out in outputs] == prompts
    for prompt, out in zip(prompts, outputs, strict=True):
        [completion] = out.outputs
        assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
        assert_greedy_matches_hf(model_path, prompt, completion.token_ids)


def test_prefix_cache_hits_give_the_same_tokens(llm: LLM, model_path: str) -> None:
    shared = _prompts(200, [48], seed=1)[0]
    prompts = [shared + tail for tail in _prompts(200, [5, 11, 2], seed=2)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts, params)
    again = llm.generate(prompts, params)  # every full block of the prompts is cached now
    for prompt, a, b in zip(prompts, first, again, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert_greedy_matches_hf(model_path, prompt, a.outputs[0].token_ids)


def test_logprobs_match_transformers_log_softmax(llm: LLM, model_path: str) -> None:
    [prompt] = _prompts(200, [21], seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    [out] = llm.generate([prompt], params)
    completion = out.outputs[0]
    reference = hf_log_softmax(model_path, prompt, completion.token_ids)
    assert completion.logprobs is not None and len(completion.logprobs) == 6
    for row, entry in zip(reference, completion.logprobs, strict=True):
        assert abs(entry.logprob - float(row[entry.token_id])) < 1e-3
        top = torch.topk(row, 3)
        assert [t.token_id for t in entry.top] == top.indices.tolist()
        for t, value in zip(entry.top, top.values.tolist(), strict=True):
            assert abs(t.logprob - value) < 1e-3


def test_preemption_under_a_tiny_kv_cache_still_matches_transformers() -> None:
    path = str(tiny_checkpoint(arch="qwen3"))
    prompts = _prompts(200, [30, 25, 28, 33, 27, 31], seed=4)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    # 16 blocks of 8 tokens = 128 tokens for six sequences of ~50 tokens: preemption is certain.
    with LLM(
        path,
        max_model_len=128,
        cache__block_size=8,
        kv_cache_memory=_bytes_for_blocks(path, blocks=16, block_size=8),
    ) as engine:
        outputs = engine.generate(prompts, params)
        preemptions = engine._run(_stats(engine)).num_preemptions
    assert preemptions > 0
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.outputs[0].token_ids) == 20
        assert_greedy_matches_hf(path, prompt, out.outputs[0].token_ids)


def _bytes_for_blocks(path: str, blocks: int, block_size: int) -> int:
    from engine.model.config import load_model_config
    from engine.model.placement.capacity import kv_block_bytes

    return blocks * kv_block_bytes(load_model_config(path), block_size, "float32")


async def _stats(engine: LLM) -> EngineStats:
    return engine.engine.stats()


def test_embeddings_match_transformers_beside_generation(llm: LLM, model_path: str) -> None:
    """Embedding requests (last-token pooling normalized, mean pooling raw) batched with
    generation traffic in the same engine; the 65-token prompt is prefilled in three chunks
    (32 tokens a step), so its mean spans them."""
    prompts = _prompts(200, [1, 9, 40, 65], seed=5)
    generating = _prompts(200, [30, 12], seed=6)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with ThreadPoolExecutor(2) as pool:
        generated = pool.submit(llm.generate, generating, params, use_tqdm=False)
        means = pool.submit(llm.embed, prompts, pooling="mean", normalize=False)
        lasts = llm.embed(prompts, pooling="last")
        for prompt, out in zip(generating, generated.result(timeout=120), strict=True):
            assert_greedy_matches_hf(model_path, prompt, out.outputs[0].token_ids)
        embedded = {("last", True): lasts, ("mean", False): means.result(timeout=120)}
    for (pooling, normalize), outputs in embedded.items():
        for prompt, out in zip(prompts, outputs, strict=True):
            assert out.prompt_token_ids == prompt and out.finished
            reference = hf_embedding(model_path, prompt, pooling, normalize)
            ours = torch.tensor(out.outputs.embedding)
            torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)
