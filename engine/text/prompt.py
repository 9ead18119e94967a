"""Prompt building: a request's prompt text, token ids or chat messages -> checked prompt token ids.

Everything a client wrote that reaches the chat template is the client's words, never the
template's: a special token written in a message's content, a tool's name, description or
parameter schema (keys included), a tool call's name or arguments, a tool message's name, a
template variable, anything of the Responses or Messages APIs carried into those, is tokenized
as the plain text it is, so a client cannot close a turn and open a forged system turn.
`allow_special_tokens_in_chat` turns this off for trusted deployments that put control tokens
in contents on purpose.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from engine.messages.requests import ChatMessage, ChatOptions, GenerateRequest
from engine.request.limits import check_prompt_length, check_token_ids_named
from engine.text.template_bounds import Bounds, install, render_bounded

# Stands in for a special token found in a chat content while the template renders: private-use
# code points no template writes, numbered so each one maps back to the text it replaced.
_PLACEHOLDER = "\ue000{}\ue001"
_PLACEHOLDER_RE = re.compile("\ue000([0-9]+)\ue001")
# A chat rendering's bounds unless the builder is given others: characters as the prompt limit
# counts them (limits.max_prompt_chars_per_token's default), and a second at most.
MAX_CHARS_PER_TOKEN = 32
TEMPLATE_SECONDS = 1.0


class PromptBuilder:
    """Turns a request's prompt, token ids or chat messages into checked prompt token ids."""

    def __init__(
        self,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        allow_special_tokens_in_chat: bool = False,
        template_bounds: Bounds | None = None,
    ) -> None:
        """`template_bounds`: what one chat rendering may take (engine/text/template_bounds.py;
        default: max_model_len x MAX_CHARS_PER_TOKEN characters, TEMPLATE_SECONDS)."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.template_bounds = template_bounds or Bounds(
            max_model_len * MAX_CHARS_PER_TOKEN, TEMPLATE_SECONDS
        )
        if tokenizer is not None:  # one that renders chats
            install()
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
            shielded({**message.template_fields(), "content": message.content}, shield)
            for message in messages
        ]
        with render_bounded(self.template_bounds):
            rendered = self.tokenizer.apply_chat_template(
                conversation,
                chat_template=chat.template,
                tokenize=False,
                add_generation_prompt=chat.add_generation_prompt,
                **shielded(chat.template_kwargs, shield),
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


def shielded(value: Any, shield: Callable[[str], str]) -> Any:
    """`value` with `shield` applied to every string in it, dictionary keys included (a tool's
    parameter names reach a template that writes the schema as JSON)."""
    if isinstance(value, str):
        return shield(value)
    if isinstance(value, dict):
        return {shielded(key, shield): shielded(item, shield) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [shielded(item, shield) for item in value]
    return value


def _special_tokens_pattern(tokenizer: Any) -> re.Pattern[str] | None:
    """Matches any of the tokenizer's special (control) tokens, longest first."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {})
    specials = {token.content for token in decoder.values() if getattr(token, "special", False)}
    specials |= set(getattr(tokenizer, "all_special_tokens", []))
    if not specials:
        return None
    ordered = sorted(specials, key=len, reverse=True)
    return re.compile("|".join(re.escape(token) for token in ordered))
