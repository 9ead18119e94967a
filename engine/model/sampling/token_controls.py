"""A sequence's token-level controls: logit_bias, allowed_token_ids, bad_words and its
structured-output grammar, applied to a step's logits batch-wide (rows without controls are
never touched; a batch without any costs nothing).

Every control is a function of the request's parameters and the sequence's output tokens, so a
sequence rebuilt from a SequenceStart after a restart is held to exactly the same rules.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from engine.messages.params import SamplingParams
from engine.structured.bitmask import apply_bitmask, fill_bitmask
from engine.structured.grammars import GrammarService, SequenceMatcher


class TokenControls:
    __slots__ = ("_allowed_mask", "allowed", "bad_words", "bias_ids", "bias_values", "matcher")

    def __init__(
        self, params: SamplingParams, vocab_size: int, grammars: GrammarService | None
    ) -> None:
        bias = {t: v for t, v in (params.logit_bias or {}).items() if 0 <= t < vocab_size}
        self.bias_ids = list(bias)
        self.bias_values = list(bias.values())
        self.allowed = params.allowed_token_ids
        self._allowed_mask: torch.Tensor | None = None
        self.bad_words: list[list[int]] = []
        self.matcher: SequenceMatcher | None = None
        if params.bad_words or params.structured_outputs is not None:
            if grammars is None:
                raise ValueError("this worker has no tokenizer for bad_words / structured_outputs")
            if params.bad_words:
                self.bad_words = bad_words_token_ids(grammars.hf_tokenizer(), params.bad_words)
            if params.structured_outputs is not None:
                self.matcher = SequenceMatcher(grammars.compile(params.structured_outputs))

    @staticmethod
    def wanted(params: SamplingParams) -> bool:
        return bool(
            params.logit_bias
            or params.allowed_token_ids is not None
            or params.bad_words
            or params.structured_outputs is not None
        )

    def allowed_mask(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[vocab] bool: the allowed tokens (kept: the list never changes)."""
        if self._allowed_mask is None or self._allowed_mask.device != device:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            ids = [t for t in self.allowed or [] if 0 <= t < vocab_size]
            mask[ids] = True
            self._allowed_mask = mask.to(device)
        return self._allowed_mask

    def banned_now(self, output: list[int]) -> list[int]:
        """Tokens that would complete a bad word after `output`."""
        banned = []
        for word in self.bad_words:
            prefix = word[:-1]
            if not prefix or output[len(output) - len(prefix) :] == prefix:
                banned.append(word[-1])
        return banned


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's rule: each word tokenized as is and with a leading space (a word at the start of
    the text and one in its middle are different tokens), the spaced form kept only when it is
    a different token sequence of the same length."""
    found: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if plain:
            found.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            found.append(spaced)
    return found


def apply_token_controls(
    logits: torch.Tensor, controls: list[TokenControls | None], outputs: list[list[int]]
) -> None:
    """allowed_token_ids, bad_words, then logit_bias, in place, each in one batched operation."""
    vocab_size = logits.shape[1]
    device = logits.device
    allowed_rows = [row for row, c in enumerate(controls) if c is not None and c.allowed]
    if allowed_rows:
        masks = []
        for row in allowed_rows:
            control = controls[row]
            assert control is not None
            masks.append(control.allowed_mask(vocab_size, device))
        index = torch.tensor(allowed_rows, device=device)
        logits[index] = logits[index].masked_fill(~torch.stack(masks), -math.inf)
    rows: list[int] = []
    columns: list[int] = []
    values: list[float] = []
    banned_rows: list[int] = []
    banned_columns: list[int] = []
    for row, control in enumerate(controls):
        if control is None:
            continue
        for token in control.banned_now(outputs[row]):
            if 0 <= token < vocab_size:
                banned_rows.append(row)
                banned_columns.append(token)
        rows += [row] * len(control.bias_ids)
        columns += control.bias_ids
        values += control.bias_values
    if banned_rows:
        logits[banned_rows, banned_columns] = -math.inf
    if rows:
        bias = torch.tensor(values, dtype=logits.dtype, device=device)
        logits.index_put_(
            (torch.tensor(rows, device=device), torch.tensor(columns, device=device)),
            bias,
            accumulate=True,
        )


def apply_grammars(
    logits: torch.Tensor,
    controls: list[TokenControls | None],
    outputs: list[list[int]],
    grammars: GrammarService | None,
) -> None:
    """Mask every constrained row to its grammar's next tokens: one bitmask, one pass."""
    rows = [row for row, c in enumerate(controls) if c is not None and c.matcher is not None]
    if not rows or grammars is None:
        return
    matchers = []
    for row in rows:
        control = controls[row]
        assert control is not None and control.matcher is not None
        matchers.append(control.matcher.ready(outputs[row]))
    bitmask = fill_bitmask(grammars.executor, matchers, logits.shape[1], grammars.eos_token_ids)
    apply_bitmask(logits, rows, bitmask)
    for row, matcher in zip(rows, matchers, strict=True):
        if matcher.is_stopped() and grammars.eos_token_ids:
            # The text is complete: EOS comes next, even where min_tokens had banned it (the
            # grammar allows nothing else, and a row of -inf would sample an arbitrary token).
            logits[row] = -math.inf
            logits[row, grammars.eos_token_ids[0]] = 0.0
