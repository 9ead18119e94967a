"""Synthetic prompts for imported traces: public traces carry lengths, never text.

Prompts are built from blocks. A block is a deterministic function of (seed, block id), so two
requests naming the same block ids get identical prompt prefixes — exactly what a prefix cache
should see as hits. Requests without block ids get blocks nobody else uses.

Two forms: token ids (exact lengths; ids drawn from `TokenRange`, by default 100..499, which is
inside any real vocabulary and the tiny test models' 512) or text (words; lengths approximate,
since the server's tokenizer decides how many tokens a word is).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

PromptFormat = Literal["tokens", "text"]

# Common short English words: one token each in most BPE vocabularies (with the leading space).
_WORD_TEXT = (
    "the of and to in is was for on are as with his they at be this from have or by one had "
    "not but what all were when we there can an your which their said if do will each about how "
    "up out them then she many some so these would other into has more her two like him see "
    "time could no make than first been its who now people my made over did down only way find "
    "use may water long little very after words called just where most know get through back"
)
_WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True)
class TokenRange:
    low: int = 100
    high: int = 500  # exclusive

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise ValueError(
                f"token range must be LOW:HIGH with 0 <= LOW < HIGH, got {self.low}:{self.high}"
            )


@dataclass
class PromptSynth:
    """Deterministic prompt blocks; equal block ids give equal blocks."""

    block_size: int
    fmt: PromptFormat = "tokens"
    tokens: TokenRange = field(default_factory=TokenRange)
    seed: int = 0
    _cache: dict[int, list[int] | list[str]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block size must be >= 1 token, got {self.block_size}")

    def prompt(self, length: int, block_ids: list[int], unique_key: str) -> list[int] | str:
        """A prompt of `length` units starting with the blocks of `block_ids`, padded with
        material of its own (keyed by `unique_key`) when the blocks are too short."""
        units: list[Any] = []
        for block_id in block_ids:
            if len(units) >= length:
                break
            units.extend(self._block(block_id))
        if len(units) < length:
            units.extend(self._units(f"own:{unique_key}", length - len(units)))
        del units[length:]
        if self.fmt == "text":
            return " ".join(units)
        return units

    def _block(self, block_id: int) -> list[int] | list[str]:
        block = self._cache.get(block_id)
        if block is None:
            block = self._cache[block_id] = self._units(f"block:{block_id}", self.block_size)
        return block

    def _units(self, key: str, count: int) -> list[Any]:
        rng = random.Random(f"{self.seed}:{key}")
        if self.fmt == "text":
            return rng.choices(_WORDS, k=count)
        return [rng.randrange(self.tokens.low, self.tokens.high) for _ in range(count)]


def request_body(
    endpoint: str,
    prompt: list[int] | str,
    max_tokens: int,
    *,
    model: str | None = None,
    ignore_eos: bool = True,
) -> dict[str, Any]:
    """A greedy request for `max_tokens` tokens (exactly that many with `ignore_eos`)."""
    body: dict[str, Any] = {}
    if model is not None:
        body["model"] = model
    if endpoint == "chat_completions":
        if not isinstance(prompt, str):
            raise ValueError("chat requests need text prompts (prompt format 'text')")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body["max_tokens"] = max_tokens
    body["temperature"] = 0.0
    if ignore_eos:
        body["ignore_eos"] = True
    return body
