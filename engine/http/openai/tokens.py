"""`/tokenize` and `/detokenize`, with vLLM's request and response shapes.

Chat messages are rendered and tokenized by a tokenizer actor, as a chat request's are, with
the client's `chat_template` if it gives one: that is the client's code, run within the
template bounds (engine/text/template_bounds.py), in that actor's process, never on the root's
event loop or in its memory; the counts are the ones a request gets. Plain text, the token
strings and /detokenize use a tokenizer the root loads on first use, off the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from engine.http.openai.chat_messages import chat_messages
from engine.http.openai.decoding import decode_request
from engine.http.openai.echo import EchoedPrompt
from engine.http.openai.errors import ApiError
from engine.http.openai.protocol import ChatMessageIn, TokenId, encode
from engine.messages.requests import ChatMessage, ChatOptions
from engine.request.outputs import EngineError
from engine.text.prompt import PromptBuilder


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's TokenizeCompletionRequest or TokenizeChatRequest: `prompt` or `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class TokenizeResponse(msgspec.Struct, kw_only=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(msgspec.Struct, kw_only=True):
    prompt: str


_TOKENIZE = msgspec.json.Decoder(TokenizeRequest)
_DETOKENIZE = msgspec.json.Decoder(DetokenizeRequest)


ChatRenderer = Callable[[list[ChatMessage], ChatOptions], Awaitable[list[int]]]


class Tokens:
    """The root's tokenizer, loaded once on first use; chats go to `render_chat` (a tokenizer
    actor: engine/library/chat_tokens.py)."""

    def __init__(
        self,
        model_path: str,
        max_model_len: int,
        allow_special_in_chat: bool,
        render_chat: ChatRenderer,
        chat_template: str | None = None,
    ) -> None:
        self._model_path = model_path
        self._render_chat = render_chat
        self._chat_template = chat_template  # the server's (--chat-template), as chats use
        self._max_model_len = max_model_len
        self._allow_special_in_chat = allow_special_in_chat
        self._builder: PromptBuilder | None = None
        self._loading = asyncio.Lock()

    async def _prompt_builder(self) -> PromptBuilder:
        async with self._loading:
            if self._builder is None:
                from engine.text.hf_tokenizer import load_tokenizer_without_torch

                tokenizer = await asyncio.to_thread(load_tokenizer_without_torch, self._model_path)
                self._builder = PromptBuilder(
                    tokenizer, self._max_model_len, len(tokenizer), self._allow_special_in_chat
                )
            return self._builder

    async def tokenize(self, body: bytes) -> bytes:
        req = decode_request(_TOKENIZE, body)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        builder = await self._prompt_builder()
        tokenizer = builder.tokenizer
        if req.prompt is not None:
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
            prompt = req.prompt
            ids = await asyncio.to_thread(
                lambda: list(tokenizer.encode(prompt, add_special_tokens=add_special))
            )
        else:
            messages = chat_messages(req.messages or [])
            chat = ChatOptions(
                req.chat_template or self._chat_template,
                dict(req.chat_template_kwargs or {}),
                req.add_generation_prompt,
            )
            ids = await self.chat_tokens(messages, chat)
        strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
        return encode(
            TokenizeResponse(
                count=len(ids), max_model_len=self._max_model_len, tokens=ids, token_strs=strs
            )
        )

    async def chat_tokens(self, messages: list[ChatMessage], chat: ChatOptions) -> list[int]:
        """A chat's prompt as a request of it gets it (rendered in a tokenizer actor, with the
        server's --chat-template unless `chat` has its own)."""
        if chat.template is None:
            chat = msgspec.structs.replace(chat, template=self._chat_template)
        try:
            return await self._render_chat(messages, chat)
        except EngineError as e:  # a template that fails on these messages: theirs to fix
            raise ApiError(e.status, e.message, param=e.param) from None

    async def text_of(self, token_ids: list[int]) -> str:
        """The ids as text, special tokens included (a rendered prompt as the model reads it)."""
        builder = await self._prompt_builder()
        decode = builder.tokenizer.decode
        return await asyncio.to_thread(lambda: decode(token_ids, skip_special_tokens=False))

    async def echo(self, prompt: str | None, token_ids: list[int]) -> EchoedPrompt:
        """The text an echoed prompt shows (the client's own when it sent text) and its first
        token's."""
        builder = await self._prompt_builder()
        decode = builder.tokenizer.decode
        text = prompt if prompt is not None else await asyncio.to_thread(decode, token_ids)
        first = decode(token_ids[:1], skip_special_tokens=False) if token_ids else ""
        return EchoedPrompt(text, first)

    async def detokenize(self, body: bytes) -> bytes:
        req = decode_request(_DETOKENIZE, body)
        builder = await self._prompt_builder()
        vocab = builder.vocab_size
        for position, token_id in enumerate(req.tokens):
            if token_id >= vocab:
                raise ApiError(
                    400,
                    f"'tokens[{position}]' = {token_id} is out of range: the vocabulary has "
                    f"{vocab} tokens",
                    param=f"tokens[{position}]",
                )
        text = await asyncio.to_thread(builder.tokenizer.decode, req.tokens)
        return encode(DetokenizeResponse(prompt=text))
