"""A chat's prompt token ids without running the model (/tokenize's `messages`): rendered and
tokenized by a tokenizer actor, as every chat is, within the same template bounds
(engine/text/template_bounds.py), never in the root process, whose event loop and memory serve
every request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.messages.params import SamplingParams
from engine.messages.requests import ChatMessage, ChatOptions, EngineRequest

if TYPE_CHECKING:
    from engine.library.async_llm import AsyncLLM


async def chat_token_ids(
    llm: AsyncLLM, messages: list[ChatMessage], chat: ChatOptions
) -> list[int]:
    """The ids `messages` render to with `chat` (its template None: the server's or the
    model's); EngineError (400 naming the bound) for a template past its bounds."""
    request = EngineRequest(
        params=SamplingParams(max_tokens=1), messages=messages, chat=chat, tokenize_only=True
    )
    final = None
    async for output in llm.submit(request):
        final = output
    assert final is not None
    return list(final.prompt_token_ids)
