"""Random LoRA adapters made by peft on the tiny test checkpoints, cached in /tmp like them, and
peft + transformers' outputs with an adapter applied (the reference).

    path = lora_adapter(tiny_checkpoint("qwen3"), rank=8, targets=ALL_MODULES, seed=1)
    logits = peft_logits(base, path, token_ids)
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from engine.settings.home import build_directory
from tests.checkpoints import CACHE_ROOT, generate_greedy

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_adapter(
    base: Path,
    *,
    rank: int,
    targets: tuple[str, ...],
    seed: int,
    alpha: int = 16,
    use_rslora: bool = False,
    extra: dict[str, Any] | None = None,
) -> Path:
    """A random PEFT LoRA adapter of `base` (B not zero: it changes the outputs), built once.
    `extra`: more LoraConfig arguments (what the engine must refuse, e.g. use_dora)."""
    spec = {
        "base": str(base),
        "rank": rank,
        "targets": targets,
        "seed": seed,
        "alpha": alpha,
        "rslora": use_rslora,
        "extra": extra or {},
    }
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    target = CACHE_ROOT / f"lora-{key}"
    if not (target / "adapter_config.json").is_file():

        def make(staging: Path) -> None:
            _make_adapter(base, staging, rank, targets, seed, alpha, use_rslora, extra or {})

        build_directory(target, make, "adapter_config.json")
    return target


def _make_adapter(
    base: Path,
    out: Path,
    rank: int,
    targets: tuple[str, ...],
    seed: int,
    alpha: int,
    use_rslora: bool,
    extra: dict[str, Any],
) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        init_lora_weights=False,  # random A and B: the adapter changes the outputs
        **extra,
    )
    peft_model = get_peft_model(model, config)
    with torch.no_grad():  # large enough to move the greedy picks of a random tiny model
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(out)


@functools.cache
def peft_model(base: Path, adapter: Path) -> Any:
    """transformers' model of `base` with peft's LoRA layers of `adapter` (a fresh base model:
    peft changes the one it wraps)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter).eval()


def peft_logits(base: Path, adapter: Path, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [tokens, vocab] of one forward pass with the adapter."""
    with torch.inference_mode():
        return peft_model(base, adapter)(torch.tensor([token_ids])).logits[0].float()


def peft_greedy(
    base: Path, adapter: Path, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], torch.Tensor]:
    """generate(do_sample=False) with the adapter: (tokens, float32 logits [steps, vocab])."""
    return generate_greedy(peft_model(base, adapter), prompt, max_new_tokens)
