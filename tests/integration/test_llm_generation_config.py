"""The library applies the model's generation_config.json like vLLM's LLM: a call without
SamplingParams samples with its defaults (here greedy, 3 tokens); an explicit one is used as is."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from engine import LLM, AsyncLLM, SamplingParams
from engine.library.llm import build_settings
from engine.text.hf_tokenizer import load_tokenizer_without_torch
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


def test_async_llm_applies_the_generation_config_and_the_chat_template(tmp_path: Path) -> None:
    """AsyncLLM, not only LLM and the server: a request without SamplingParams gets the model's
    generation defaults, a chat without a template of its own model.chat_template."""
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3})
    )
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    settings = build_settings(
        **{
            "model.path": str(tiny_checkpoint(arch="qwen3")),
            "model.generation_config": str(tmp_path),
            "model.chat_template": template,
            "cache.kv_cache_memory": 4 * 2**20,
            "model.max_model_len": 128,
        }
    )

    async def collect(engine: AsyncLLM, **request: Any) -> tuple[list[int], list[int]]:
        prompt_ids: list[int] = []
        tokens: list[int] = []
        async for out in engine.stream(**request):
            prompt_ids = prompt_ids or out.prompt_token_ids
            tokens += [token for output in out.outputs for token in output.token_ids]
        return prompt_ids, tokens

    async def run() -> list[tuple[list[int], list[int]]]:
        engine = AsyncLLM(settings)
        await engine.start()
        try:
            greedy = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            return [
                await collect(engine, prompt="the defaults say"),
                await collect(engine, prompt="the defaults say", params=greedy),
                await collect(engine, messages=[{"role": "user", "content": "hi"}]),
            ]
        finally:
            await engine.shutdown()

    (_, by_default), (_, explicit), (chat_prompt, _) = asyncio.run(asyncio.wait_for(run(), 120))
    assert len(explicit) == 3 and by_default == explicit[: len(by_default)]  # may stop at EOS
    tokenizer = load_tokenizer_without_torch(str(tiny_checkpoint(arch="qwen3")))
    assert chat_prompt == tokenizer.encode("[hi]", add_special_tokens=False)
