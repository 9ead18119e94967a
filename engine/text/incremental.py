"""Token ids to text, one token at a time, never cutting a UTF-8 character in half.

Decoding each new token alone is wrong for most tokenizers: byte-level BPE splits characters
across tokens, and some decoders change a token's text depending on what precedes it (a leading
space). So, as vLLM does, two offsets walk along the ids: text is decoded from `prefix_offset`,
both up to `read_offset` (already emitted) and up to the end; the difference is new text, emitted
only when it does not end in U+FFFD (an incomplete character, to be completed by later tokens).
A few prompt tokens seed the window so the first output token decodes in context.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first output tokens (as vLLM)
REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """A `tokenizers.Tokenizer` (what a transformers fast tokenizer's backend_tokenizer is)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


def as_decoder(tokenizer: Any) -> TokenDecoder:
    """The raw decoder of a transformers fast tokenizer, or the object itself.

    The backend's decode is transformers' decode without clean_up_tokenization_spaces, which
    would make text depend on where it was cut.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder: TokenDecoder = backend if backend is not None else tokenizer
    return decoder


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = as_decoder(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        # The window: ids from the prefix offset on (older ones are dropped as it moves), of
        # which the first `_read_offset` are already turned into text.
        self._ids: list[int] = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None

    def step(self, token_id: int) -> str:
        """Append one token; the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        prefix_text = self._prefix()
        text = self._decode(self._ids)
        if len(text) <= len(prefix_text) or text.endswith(REPLACEMENT_CHAR):
            return ""
        # Move the window: what was read becomes the prefix, everything so far is read.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end, as U+FFFD)."""
        prefix_text = self._prefix()
        text = self._decode(self._ids)
        if len(text) <= len(prefix_text):
            return ""
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return text[len(prefix_text) :]

    def _prefix(self) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read_offset])
        return self._prefix_text

    def _decode(self, ids: list[int]) -> str:
        return self._decoder.decode(ids, skip_special_tokens=self.skip_special_tokens)
