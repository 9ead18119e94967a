"""The library applies the model's generation_config.json like vLLM's LLM: a call without
SamplingParams samples with its defaults (here greedy, 3 tokens); an explicit one is used as is."""

from __future__ import annotations

import json
from pathlib import Path

from engine import LLM, SamplingParams
from tests.checkpoints import tiny_checkpoint


def test_generate_without_params_uses_the_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3})
    )
    with LLM(
        str(tiny_checkpoint(arch="qwen3")),
        generation_config=str(tmp_path),
        served_model_name="tiny",
        kv_cache_memory_bytes=4 * 2**20,
        max_model_len=128,
    ) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 3)
        prompt = "the generation config says"
        (by_default,) = llm.generate(prompt, use_tqdm=False)
        greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
        (explicit,) = llm.generate(prompt, greedy, use_tqdm=False)
        longer = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        (own,) = llm.generate(prompt, longer, use_tqdm=False)
    assert len(explicit.outputs[0].token_ids) == 3 and len(own.outputs[0].token_ids) == 8
    sampled = by_default.outputs[0].token_ids
    assert sampled == explicit.outputs[0].token_ids[: len(sampled)]  # may stop early at EOS
    assert own.outputs[0].token_ids[:3] == explicit.outputs[0].token_ids
    # vLLM's RequestOutput fields: cache hits known once scheduled; no stop_reason at a length
    assert explicit.num_cached_tokens is not None and explicit.num_cached_tokens >= 0
    assert (explicit.outputs[0].finish_reason, explicit.outputs[0].stop_reason) == ("length", None)
