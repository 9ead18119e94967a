"""engine: an LLM serving engine built as supervised actors over shared-memory rings.

Public library API: `LLM` (blocking), `AsyncLLM` (asyncio), `SamplingParams` (with
`StructuredOutputsParams` for constrained outputs), `LoRARequest` (an adapter to run with), and
the result types `RequestOutput` /
`CompletionOutput` / `Logprob` / `TokenLogprob`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.messages.params import LoRARequest, SamplingParams, StructuredOutputsParams
from engine.request.outputs import (
    CompletionOutput,
    EngineError,
    Logprob,
    RequestOutput,
    TokenLogprob,
)

if TYPE_CHECKING:
    from engine.library.async_llm import AsyncLLM
    from engine.library.llm import LLM

__all__ = [
    "LLM",
    "AsyncLLM",
    "CompletionOutput",
    "EngineError",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TokenLogprob",
]


def __getattr__(name: str) -> Any:
    # Lazy: `python -m engine admin ...` and the actor children import this package and must
    # not pay for the engine client's imports.
    if name == "LLM":
        from engine.library.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from engine.library.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
