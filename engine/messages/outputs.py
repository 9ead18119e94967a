"""Channel detokenizer -> gateway: one OutputBatch per step with every request's new text."""

from __future__ import annotations

import msgspec

from engine.messages.codec import Channel
from engine.messages.failures import RequestFailed
from engine.messages.kv_transfer import KvSource
from engine.messages.scheduling import FirstScheduled


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    token: str
    logprob: float


class SampleLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of one generated token: the sampled one and the top alternatives."""

    token_id: int
    token: str
    logprob: float
    top: list[TokenLogprob]


class SampleDeltaText(msgspec.Struct, array_like=True):
    request_id: str
    epoch: int
    index: int
    token_ids: list[int]
    text: str
    logprobs: list[SampleLogprobs] | None
    finish_reason: str | None
    # What ended a "stop": the stop string matched or the stop token id; None for EOS or length.
    stop_reason: str | int | None = None
    first: FirstScheduled | None = None  # passed on from the scheduler's SampleDelta
    # Logprobs of prompt tokens 1.., once per epoch when asked for (the scheduler's, named).
    prompt_logprobs: list[SampleLogprobs] | None = None
    handoff: KvSource | None = None  # passed on from the scheduler's SampleDelta
    embedding: bytes | None = None  # passed on from the scheduler's SampleDelta


class TextStarted(msgspec.Struct, array_like=True):
    """Sent once per request and epoch, when the detokenizer learns of it (its TextStart): the
    request got past the tokenizer, and the scheduler has taken it in."""

    request_id: str
    epoch: int


class OutputBatch(msgspec.Struct, tag=True, array_like=True):
    started: list[TextStarted]
    samples: list[SampleDeltaText]
    failures: list[RequestFailed]


DETOKENIZER_TO_GATEWAY: Channel[OutputBatch] = Channel("detokenizer-to-gateway", OutputBatch)
