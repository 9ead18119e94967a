"""Token bitmasks (llguidance's layout: bit j of int32 word i allows token 32 i + j) applied to a
batch's logits in one pass: only the rows of constrained sequences are touched."""

from __future__ import annotations

import math
import sys

import llguidance
import torch

from engine.structured.limits import matcher_error


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
        for matcher, _ in running:  # a limit met computing the mask: never a finished grammar
            if matcher.is_error():
                raise matcher_error(matcher, "structured_outputs")
    for row, matcher in enumerate(matchers):
        if matcher.is_stopped():
            for token in eos_token_ids:
                if 0 <= token < vocab_size:
                    bitmask[row, token // 32] |= _bit(token % 32)
    return bitmask


def _byte_masks() -> torch.Tensor:
    """[256, 8] float32: for each byte value, 0 where its bit (little-endian order) is set and
    -inf where not. A bitmask's bytes index it: one lookup turns 8 tokens' bits into logit
    offsets, far cheaper than unpacking bits and masking with them: one gather of 8 floats per
    byte replaces a shift, a compare and a select per token."""
    bits = torch.tensor([[(value >> j) & 1 for j in range(8)] for value in range(256)])
    return torch.zeros(256, 8).masked_fill_(bits == 0, -math.inf)


_BYTE_MASKS = _byte_masks()


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set the disallowed logits of `rows` (bitmask row i belongs to logits row rows[i]) to -inf,
    in place, in one batched operation; other rows are not touched."""
    assert sys.byteorder == "little"  # bit j of an int32 word is bit j % 8 of byte j // 8
    vocab_size = logits.shape[1]
    table = _BYTE_MASKS.to(device=logits.device, dtype=logits.dtype)
    as_bytes = bitmask.contiguous().view(torch.uint8).view(-1).to(logits.device).long()
    offsets = table.index_select(0, as_bytes).view(len(rows), -1)[:, :vocab_size]
    logits.index_add_(0, torch.tensor(rows, device=logits.device), offsets)


def _bit(position: int) -> int:
    """Bit `position` of an int32 word, as the signed value torch stores (bit 31 is negative)."""
    return -(1 << 31) if position == 31 else 1 << position
