"""Token bitmasks (llguidance's layout: bit j of int32 word i allows token 32 i + j) applied to a
batch's logits in one pass: only the rows of constrained sequences are touched."""

from __future__ import annotations

import math

import llguidance
import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def words_for(vocab_size: int) -> int:
    return -(-vocab_size // 32)


def fill_bitmask(
    executor: llguidance.LLExecutor,
    matchers: list[llguidance.LLMatcher],
    vocab_size: int,
    eos_token_ids: list[int],
) -> torch.Tensor:
    """[len(matchers), words] int32: each matcher's next allowed tokens, computed in one call
    (llguidance's executor spreads the rows over its threads). A finished matcher allows only
    EOS: the sequence must stop where its grammar does."""
    bitmask = torch.zeros(len(matchers), words_for(vocab_size), dtype=torch.int32)
    running = [(matcher, row) for row, matcher in enumerate(matchers) if not matcher.is_stopped()]
    if running:
        executor.unsafe_compute_mask_ptr(
            running, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )
    for row, matcher in enumerate(matchers):
        if matcher.is_stopped():
            for token in eos_token_ids:
                if 0 <= token < vocab_size:
                    bitmask[row, token // 32] |= _bit(token % 32)
    return bitmask


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool from a [rows, words] int32 bitmask."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set the disallowed logits of `rows` (bitmask row i belongs to logits row rows[i]) to -inf,
    in place, in one batched operation."""
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[1])
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, -math.inf)


def _bit(position: int) -> int:
    """Bit `position` of an int32 word, as the signed value torch stores (bit 31 is negative)."""
    return -(1 << 31) if position == 31 else 1 << position
