"""Hugging Face transformers as the reference our outputs are judged against (docs/architecture.md,
'Tests and measurement')."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

TIE_TOLERANCE = 1e-4  # two logits this close are a tie: either token is a correct greedy choice
# In bfloat16 (8 bits of mantissa) two implementations' logits of a tiny model (magnitudes up to
# ~10) differ by up to ~0.17 (ours against transformers', measured on the llama and qwen
# families): two logits closer than this are a tie there.
BF16_TIE_TOLERANCE = 0.25


@lru_cache(maxsize=4)
def hf_model(path: str, dtype: torch.dtype = torch.float32):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval()


@lru_cache(maxsize=4)
def hf_tokenizer(path: str):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


@torch.inference_mode()
def hf_logits(
    path: str | Path, token_ids: list[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Logits [len(token_ids), vocab] of one unpadded sequence, as float32, of the model run in
    `dtype`."""
    model = hf_model(str(path), dtype)
    return model(torch.tensor([token_ids])).logits[0].float()


def assert_greedy_matches_hf(path: str | Path, prompt_ids: list[int], ours: list[int]) -> None:
    """Our greedy continuation equals HF's, where a divergence at a near-tie counts as a tie."""
    assert ours, "no tokens generated"
    assert_greedy_matches_logits(hf_logits(path, prompt_ids + ours), len(prompt_ids), ours)


def assert_greedy_matches_logits(
    logits: torch.Tensor, prompt_len: int, ours: list[int], tolerance: float = TIE_TOLERANCE
) -> None:
    """Judged position by position on the reference's logits for prompt + our tokens: each of our
    tokens must be its argmax, or within `tolerance` of it (then the rest may legitimately
    differ)."""
    for step, token in enumerate(ours):
        row = logits[prompt_len - 1 + step]
        best = int(row.argmax())
        if token == best:
            continue
        gap = float(row[best] - row[token])
        assert gap <= tolerance, (
            f"token {step} of the continuation is {token} but the reference's argmax is {best} "
            f"(logit gap {gap:.3g} > tie tolerance {tolerance}); ours={ours}"
        )
        return  # a tie: what follows is a different but equally valid greedy path


def hf_log_softmax(path: str | Path, prompt_ids: list[int], ours: list[int]) -> torch.Tensor:
    """HF log-softmax rows that predicted each of our tokens: [len(ours), vocab]."""
    logits = hf_logits(path, prompt_ids + ours)
    rows = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(ours)]
    return torch.log_softmax(rows, dim=-1)


@torch.inference_mode()
def hf_embedding(
    path: str | Path, token_ids: list[int], pooling: str, normalize: bool
) -> torch.Tensor:
    """vLLM's pooling of transformers' last_hidden_state (the base model's output, after the
    final norm): the last token's ("last") or the mean over the prompt ("mean"), L2-normalized
    if asked. The base model is the causal LM's own (`.model`, what AutoModel loads), so a
    checkpoint loaded for logits is not loaded again."""
    base = hf_model(str(path)).model
    hidden = base(torch.tensor([token_ids])).last_hidden_state[0].float()
    vector = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector
