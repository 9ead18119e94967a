"""Public result types of the library API (as vLLM's RequestOutput / CompletionOutput).

`Logprob` (a generated token's id, text and logprob, with `top`: the most likely tokens at its
position as `TokenLogprob`s) is the very struct the detokenizer sends; nothing converts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.messages.outputs import SampleLogprobs as Logprob
from engine.messages.outputs import TokenLogprob

if TYPE_CHECKING:
    from engine.messages.failures import RequestFailed

__all__ = ["CompletionOutput", "EngineError", "Logprob", "RequestOutput", "TokenLogprob"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None  # one per token in token_ids, when asked for


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False


class EngineError(Exception):
    """A request the engine refused or could not serve, with an HTTP-like status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    @classmethod
    def from_failure(cls, failure: RequestFailed) -> EngineError:
        """The client's error for an actor's RequestFailed (the one place that converts)."""
        return cls(failure.message, failure.status, failure.param)

    @property
    def retryable(self) -> bool:
        """Whether sending the request again may succeed: not for a 4xx (its input is at
        fault), except 429 (the queue was full); yes for the engine's own failures."""
        return self.status >= 500 or self.status == 429
