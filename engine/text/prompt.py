"""Prompt building: a request's prompt text, token ids or chat messages -> checked prompt token ids.

Chat contents are the client's words, never the template's: a special token written in a
message (`<|im_end|>`) is tokenized as the plain text it is, so a user cannot close their own
turn and open a forged system turn. `allow_special_tokens_in_chat` turns this off for trusted
deployments that put control tokens in contents on purpose.
"""

from __future__ import annotations

import re
from typing import Any

from engine.messages.requests import ChatMessage, ChatOptions, GenerateRequest
from engine.request.limits import check_prompt_length, check_token_ids_named

# Stands in for a special token found in a chat content while the template renders: private-use
# code points no template writes, numbered so each one maps back to the text it replaced.
_PLACEHOLDER = "\ue000{}\ue001"
_PLACEHOLDER_RE = re.compile("\ue000([0-9]+)\ue001")


class PromptBuilder:
    """Turns a request's prompt, token ids or chat messages into checked prompt token ids."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        allow_special_tokens_in_chat: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self._special_re: re.Pattern[str] | None = None
        if not allow_special_tokens_in_chat:
            self._special_re = _special_tokens_pattern(tokenizer)

    def build(self, submitted: GenerateRequest) -> list[int]:
        """The prompt token ids; raises EngineError / ValueError naming the field."""
        request = submitted.request
        if request.prompt_token_ids is not None:
            token_ids = request.prompt_token_ids
            self._check_ids(token_ids)
        elif request.messages is not None:
            token_ids = self.chat_token_ids(request.messages, request.chat or ChatOptions())
        elif request.prompt is not None:
            token_ids = self.tokenizer.encode(request.prompt)
        else:
            raise ValueError("a request needs a prompt, prompt token ids or messages")
        max_tokens = request.params.max_tokens if submitted.resume is None else None
        check_prompt_length(len(token_ids), max_tokens, self.max_model_len)
        check_token_ids_named(request.params, self.vocab_size)
        return list(token_ids)

    def chat_token_ids(self, messages: list[ChatMessage], chat: ChatOptions) -> list[int]:
        literals: list[str] = []  # special-token text taken out of contents, by placeholder

        def shield(content: str) -> str:
            if self._special_re is None:
                return content

            def swap(match: re.Match[str]) -> str:
                literals.append(match.group(0))
                return _PLACEHOLDER.format(len(literals) - 1)

            return self._special_re.sub(swap, content)

        conversation = [
            {**message.template_fields(), "content": shield(message.content)}
            for message in messages
        ]
        rendered = self.tokenizer.apply_chat_template(
            conversation,
            chat_template=chat.template,
            tokenize=False,
            add_generation_prompt=chat.add_generation_prompt,
            **chat.template_kwargs,
        )
        if not literals:  # the template already wrote the special tokens it wants
            return list(self.tokenizer.encode(rendered, add_special_tokens=False))
        token_ids: list[int] = []
        # Odd parts are placeholder numbers: their text is tokenized as text, not as controls.
        for position, part in enumerate(_PLACEHOLDER_RE.split(rendered)):
            if position % 2:
                text = literals[int(part)]
                token_ids += self.tokenizer.encode(
                    text, add_special_tokens=False, split_special_tokens=True
                )
            elif part:
                token_ids += self.tokenizer.encode(part, add_special_tokens=False)
        return token_ids

    def _check_ids(self, token_ids: list[int]) -> None:
        for token_id in token_ids:
            if not 0 <= token_id < self.vocab_size:
                raise ValueError(
                    f"prompt token id {token_id} is out of range: the vocabulary has "
                    f"{self.vocab_size} tokens (ids 0..{self.vocab_size - 1})"
                )


def _special_tokens_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """Matches any of the tokenizer's special (control) tokens, longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    specials = {token.content for token in decoder.values() if getattr(token, "special", False)}
    specials |= set(getattr(tokenizer, "all_special_tokens", []))
    if not specials:
        return None
    ordered = sorted(specials, key=len, reverse=True)
    return re.compile("|".join(re.escape(token) for token in ordered))
