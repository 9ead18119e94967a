"""Public result types of the library API (as vLLM's RequestOutput / CompletionOutput).

`Logprob` (a generated token's id, text and logprob, with `top`: the most likely tokens at its
position as `TokenLogprob`s) is the very struct the detokenizer sends; nothing converts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.messages.outputs import SampleLogprobs as Logprob
from engine.messages.outputs import TokenLogprob
from engine.messages.scheduling import FirstScheduled

if TYPE_CHECKING:
    from engine.messages.failures import RequestFailed

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineError",
    "Logprob",
    "RequestOutput",
    "TokenLogprob",
]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None  # one per token in token_ids, when asked for
    # vLLM's: the stop string matched or the stop token id that ended a "stop"; None for EOS
    stop_reason: str | int | None = None
    # An embedding request's (SamplingParams.pooling) vector, on its finished output.
    embedding: list[float] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    scheduling: FirstScheduled | None = None  # its queue and prefill times, once known
    # vLLM's prompt_logprobs: None for the first prompt token, then each token's logprob given
    # those before it, with the top alternatives (when SamplingParams.prompt_logprobs is set).
    prompt_logprobs: list[Logprob | None] | None = None
    # P/D across instances: on a prefill instance, where a decode instance pulls this
    # request's KV from (pass it as the decode request's kv_transfer_params).
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """As vLLM's: one prompt's embedding (`outputs.embedding`), from LLM.embed."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


class EngineError(Exception):
    """A request the engine refused or could not serve, with an HTTP-like status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.retry_after = retry_after  # a 429's or 503's seconds to wait (Retry-After)

    @classmethod
    def from_failure(cls, failure: RequestFailed) -> EngineError:
        """The client's error for an actor's RequestFailed (the one place that converts)."""
        return cls(failure.message, failure.status, failure.param)


def snapshot(total: RequestOutput) -> RequestOutput:
    """A copy the caller may keep while `total` goes on growing."""
    outputs = [
        CompletionOutput(
            o.index,
            o.text,
            list(o.token_ids),
            o.finish_reason,
            None if o.logprobs is None else list(o.logprobs),
            o.stop_reason,
            o.embedding,
        )
        for o in sorted(total.outputs, key=lambda output: output.index)
    ]
    return RequestOutput(
        total.request_id,
        total.prompt,
        list(total.prompt_token_ids),
        outputs,
        total.finished,
        total.num_cached_tokens,
        total.scheduling,
        total.prompt_logprobs,
    )


def merge_outputs(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    if total is None:
        total = RequestOutput(delta.request_id, delta.prompt, delta.prompt_token_ids, [])
    total.prompt_token_ids = delta.prompt_token_ids or total.prompt_token_ids
    merge_into(total, delta)
    return total


def merge_into(total: RequestOutput, later: RequestOutput) -> None:
    """Fold `later` into `total`, as if the reader had taken both: per sample, text and tokens
    appended, the later finish reason kept."""
    total.finished = later.finished
    if later.prompt_logprobs is not None:
        total.prompt_logprobs = later.prompt_logprobs
    if later.scheduling is not None:
        total.num_cached_tokens, total.scheduling = later.num_cached_tokens, later.scheduling
    by_index = {output.index: output for output in total.outputs}
    for part in later.outputs:
        output = by_index.get(part.index)
        if output is None:
            output = CompletionOutput(part.index, "", [], None, None)
            by_index[part.index] = output
            total.outputs.append(output)
        output.text += part.text
        output.token_ids.extend(part.token_ids)
        output.finish_reason = part.finish_reason or output.finish_reason
        output.stop_reason = part.stop_reason if part.finish_reason else output.stop_reason
        if part.logprobs is not None:
            output.logprobs = (output.logprobs or []) + part.logprobs
        output.embedding = part.embedding or output.embedding
