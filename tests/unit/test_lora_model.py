"""LoRA adapters in the model runner against peft + transformers on the same checkpoint and
adapter: logits and greedy tokens per adapter, and a batch mixing the base model and two adapters
equal to each alone; adapters the engine cannot apply are refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine.launch.lora import lora_worker_fields
from engine.library.llm import build_settings
from engine.lora.registry import start_registry
from engine.messages.params import LoRARequest
from engine.model.config import load_model_config
from engine.model.lora.files import AdapterError, check_adapter
from engine.model.runner import ModelRunner
from engine.model.step_inputs import SeqChunk
from tests.checkpoints import (
    assert_same_greedy,
    greedy_generate,
    hf_greedy,
    hf_logits,
    tiny_checkpoint,
)
from tests.lora_adapters import ALL_MODULES, lora_adapter, peft_greedy, peft_logits

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [11, 12, 13, 14, 15, 16, 200, 300, 8], [400, 2, 9]]


@pytest.fixture(scope="module")
def base() -> Path:
    return tiny_checkpoint("qwen3")


@pytest.fixture(scope="module")
def adapters(base: Path) -> dict[str, LoRARequest]:
    """Two adapters: every projection at rank 8 (rank-stabilized scaling), and q/v at rank 4."""
    wide = lora_adapter(base, rank=8, targets=ALL_MODULES, seed=1, use_rslora=True)
    narrow = lora_adapter(base, rank=4, targets=("q_proj", "v_proj"), seed=2, alpha=32)
    return {
        "wide": LoRARequest("wide", 1, str(wide)),
        "narrow": LoRARequest("narrow", 2, str(narrow)),
    }


@pytest.fixture(scope="module")
def runner(base: Path) -> ModelRunner:
    """The compiled CPU backend, the default on a CPU (packed weights; base-only decode steps
    take its fused decode, steps with an adapter the layers)."""
    return ModelRunner(
        str(base), kv_cache_memory=1 << 20, max_model_len=128, kernel_backend="cpu", max_lora_rank=8
    )


def test_logits_with_each_adapter_match_peft(
    runner: ModelRunner, base: Path, adapters: dict[str, LoRARequest]
) -> None:
    prompt = PROMPTS[0]
    table = list(range(4))
    for lora in adapters.values():
        chunk = SeqChunk(0, prompt, 0, table, True, lora=lora)
        every_row = runner.execute(runner.prepare([chunk], every_row={0}))
        expected = peft_logits(base, Path(lora.lora_path), prompt)
        torch.testing.assert_close(every_row, expected, atol=2e-4, rtol=1e-4)


def test_greedy_tokens_with_each_adapter_match_peft(
    runner: ModelRunner, base: Path, adapters: dict[str, LoRARequest]
) -> None:
    for lora in adapters.values():
        ours = greedy_generate(runner, PROMPTS[1:2], max_new_tokens=8, loras=[lora])
        theirs = peft_greedy(base, Path(lora.lora_path), PROMPTS[1], max_new_tokens=8)
        assert_same_greedy(ours[0], theirs)
        assert ours[0] != hf_greedy(base, PROMPTS[1], 8)[0], "the adapter changes nothing"


def test_a_batch_of_the_base_model_and_two_adapters_equals_each_alone(
    runner: ModelRunner, adapters: dict[str, LoRARequest]
) -> None:
    """Interleaved so that rows of one adapter are not contiguous; chunked prefill mixes
    prefill chunks with decode tokens in one step."""
    loras = [adapters["wide"], None, adapters["narrow"], adapters["wide"]]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    mixed = greedy_generate(runner, prompts, max_new_tokens=6, chunk_size=4, loras=loras)
    for prompt, lora, tokens in zip(prompts, loras, mixed, strict=True):
        alone = greedy_generate(runner, [prompt], max_new_tokens=6, loras=[lora])
        assert tokens == alone[0], f"adapter {lora and lora.lora_name}: batched != alone"


def test_adapters_the_engine_cannot_apply_are_refused_in_one_line(
    base: Path, tmp_path: Path
) -> None:
    config = load_model_config(base)
    wide = lora_adapter(base, rank=8, targets=ALL_MODULES, seed=1, use_rslora=True)
    with pytest.raises(AdapterError, match=r"its rank \(r\) exceeds --max-lora-rank 4"):
        check_adapter(wide, config, max_rank=4)
    dora = lora_adapter(base, rank=4, targets=("q_proj",), seed=3, extra={"use_dora": True})
    with pytest.raises(AdapterError, match="use_dora is not supported"):
        check_adapter(dora, config, max_rank=8)
    other = tiny_checkpoint("qwen3", hidden_size=32)  # another model's adapter: shapes differ
    foreign = lora_adapter(other, rank=4, targets=("q_proj",), seed=4)
    with pytest.raises(AdapterError, match="its tensor shapes do not fit the base model"):
        check_adapter(foreign, config, max_rank=8)
    edited = tmp_path / "edited"
    shutil.copytree(wide, edited)
    raw = json.loads((edited / "adapter_config.json").read_text())
    (edited / "adapter_config.json").write_text(json.dumps({**raw, "bias": "all"}))
    with pytest.raises(AdapterError, match="bias is not supported"):
        check_adapter(edited, config, max_rank=8)
    with pytest.raises(AdapterError, match=r"no adapter_config\.json"):
        check_adapter(tmp_path / "missing", config, max_rank=8)
    embedding = lora_adapter(base, rank=4, targets=("embed_tokens",), seed=5)
    with pytest.raises(AdapterError, match="targets modules this engine does not support"):
        check_adapter(embedding, config, max_rank=8)


def test_start_adapters_are_checked_by_the_plan_and_served_by_name(base: Path) -> None:
    """--lora-modules: every adapter is checked against the base model before anything starts
    (a one-line error naming the first that does not fit); the root then serves each by name."""
    wide = lora_adapter(base, rank=8, targets=ALL_MODULES, seed=1, use_rslora=True)
    narrow = lora_adapter(base, rank=4, targets=("q_proj", "v_proj"), seed=2, alpha=32)
    config = load_model_config(base)
    modules = [
        "narrow=" + str(narrow),
        json.dumps({"name": "wide", "path": str(wide), "base_model_name": "m"}),
    ]
    settings = build_settings(**{"lora.enable_lora": True, "lora.lora_modules": modules})
    assert lora_worker_fields(settings, config) == {"max_lora_rank": 16, "max_cpu_loras": 1}
    registry = start_registry(settings.lora, config, ["base"], base)
    assert registry is not None and registry.names() == ("narrow", "wide")
    assert registry.get("wide") == LoRARequest("wide", 2, str(wide))
    assert registry.parents == {"wide": "m"}  # /v1/models shows it as the adapter's parent
    small = build_settings(settings, **{"lora.max_lora_rank": 4})
    with pytest.raises(AdapterError, match=r"its rank \(r\) exceeds --max-lora-rank 4"):
        lora_worker_fields(small, config)
    with pytest.raises(ValueError, match="is the base model's name"):
        registry.load("base", str(narrow))


def test_quantized_base_weights_take_the_adapter_too(
    base: Path, adapters: dict[str, LoRARequest]
) -> None:
    """q8_0 base weights: the adapter's update lands on the quantized matmuls' outputs, so
    the logits are peft's within the base model's own quantization error (the update itself
    moves them by far more), and a mixed batch still equals each alone."""
    runner = ModelRunner(
        str(base), kv_cache_memory=1 << 20, max_model_len=128, quantization="q8_0", max_lora_rank=8
    )
    prompt, lora = PROMPTS[0], adapters["wide"]
    ours = runner.execute(runner.prepare([SeqChunk(0, prompt, 0, [0, 1], True, lora=lora)], {0}))
    plain = runner.execute(runner.prepare([SeqChunk(1, prompt, 0, [2, 3], True)], {1}))
    reference = peft_logits(base, Path(lora.lora_path), prompt)
    quantization_error = (plain - hf_logits(base, prompt)).abs().max()
    assert (ours - reference).abs().max() <= 2 * quantization_error
    assert (reference - hf_logits(base, prompt)).abs().max() > 10 * quantization_error
    loras = [lora, None, adapters["narrow"]]
    mixed = greedy_generate(runner, PROMPTS, max_new_tokens=4, loras=loras)
    alone = [
        greedy_generate(runner, [p], 4, loras=[a])[0] for p, a in zip(PROMPTS, loras, strict=True)
    ]
    assert mixed == alone
